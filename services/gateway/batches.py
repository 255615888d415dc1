"""OpenAI's Batch API on the job machinery: each line of the input file becomes a job, at a priority after
interactive traffic; the output and error files are written when every job has ended.

State lives in Redis, so any gateway can carry a batch on and none holds it alone:

    inflight:req:{batch_id}          hash   the batch (status, file ids, timestamps, cursor); its "status"
                                            is also what the per-key job quota reads: a batch counts once
    inflight:req:{batch_id}:lines    list   one entry per line taken, in line order: its custom_id and job
                                            id, or the error that kept it from running
    inflight:batches:active:{topic}  set    batches still submitting or running (the sweep's work list)
    inflight:batches-of:{owner}      zset   a key's batches by creation time (listing)

Progress (``advance``) runs under a short per-batch lock: submit lines from the cursor, as many as the
batch's pace allows, until the cluster is at capacity (a 429 leaves the rest for the next round), then
count the jobs' statuses, and once all have ended, write the files. A line's job id is derived from the
batch id and line index, and a line is submitted only if that job has no record yet: a gateway that dies
between producing a job and moving the cursor leaves a job that the next round adopts instead of running
the line twice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import Any, cast

from redis.asyncio import Redis

from services.common import keys
from services.common.wire import COMPLETED, QUEUED, TERMINAL
from services.gateway.batch_lines import index_key, read_lines
from services.gateway.errors import APIError
from services.gateway.files_routes import store_file
from services.gateway.jobs_routes import prepare_job, tool_reading
from services.gateway.responses import response_from_record
from services.gateway.state import Gateway

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
FINISHED = TERMINAL | {"expired"}  # a batch's final statuses
# Lower values run first: a batch's jobs come after interactive requests (priority 0 unless they set one).
# It is the engine's BACKGROUND_PRIORITY (engine/sched/policy.py, not imported: it pulls in torch), so
# under fcfs, the default policy, they also wait behind every interactive request in an engine's queue.
BATCH_PRIORITY = 1_000_000


def active_key(gw: Gateway) -> str:
    """The set of batches still submitting or running, per request topic: a gateway carries on only the
    batches whose jobs go to its own topic (deployments, or test stacks, may share one Redis)."""
    return f"{keys.PREFIX}:batches:active:{gw.settings.kafka_topic}"


_LOCK_MS = 30_000
_SUBMIT_PER_ROUND = 256  # lines one advance submits at most: a round stays short
# How often each gateway advances its active batches. A batch submits at most ``batch_max_queued`` lines a
# second, and a round at most this interval's share of them: its lines reach the broker, the worker's
# claims and the engine a few at a time. Submitted once a second, a second's lines arrived together and
# every process on an interactive request's way (gateway, worker, engine) took them in at once, and the
# requests that came in meanwhile waited behind them (docs/benchmarks.md, "Paced batches").
SWEEP_S = 0.2
_READ_CHUNK = 500  # job records a pipelined read asks for at once when the output files are written


def _eval_args(call: tuple[str, list[str], list[str]]) -> tuple[Any, ...]:
    """A store script call as ``pipeline.eval``'s arguments (script, number of keys, keys, args)."""
    script, keys_, args = call
    return (script, len(keys_), *keys_, *args)


def batch_key(batch_id: str) -> str:
    return keys.record(batch_id)


def lines_key(batch_id: str) -> str:
    return keys.record(batch_id) + ":lines"


def owner_index(owner: str) -> str:
    return f"{keys.PREFIX}:batches-of:{{{owner or 'anonymous'}}}"


def line_job_id(batch_id: str, index: int) -> str:
    return f"job-{batch_id}-{index}"


def batch_object(record: dict[str, str], counts: dict[str, int] | None = None) -> dict[str, Any]:
    def ts(name: str) -> int | None:
        value = record.get(name)
        return int(float(value)) if value else None

    return {
        "id": record["id"],
        "object": "batch",
        "endpoint": record["endpoint"],
        "errors": None,
        "input_file_id": record["input_file_id"],
        "completion_window": record["completion_window"],
        "status": record["status"],
        "output_file_id": record.get("output_file_id") or None,
        "error_file_id": record.get("error_file_id") or None,
        "created_at": ts("created_at"),
        "in_progress_at": ts("in_progress_at"),
        "expires_at": ts("expires_at"),
        "finalizing_at": ts("finalizing_at"),
        "completed_at": ts("completed_at"),
        "failed_at": None,
        "expired_at": ts("expired_at"),
        "cancelling_at": ts("cancelling_at"),
        "cancelled_at": ts("cancelled_at"),
        "request_counts": counts or json.loads(record.get("request_counts") or '{"total": 0}'),
        "metadata": json.loads(record.get("metadata") or "null"),
    }


def _line_error(index: int, custom_id: Any, status: int | None, error: dict[str, Any]) -> str:
    """An error file line: a request refused (status: its HTTP answer) or a line that is no request."""
    custom = custom_id if isinstance(custom_id, str) else None
    response = None if status is None else {"status_code": status, "request_id": None, "body": error}
    return json.dumps(
        {
            "id": f"batch_req_{index}",
            "custom_id": custom,
            "response": response,
            "error": None if status is not None else error["error"],
        }
    )


def parse_line(raw: str, endpoint: str) -> tuple[str, dict[str, Any]]:
    """(custom_id, body) of one input line; ValueError saying what is wrong with it."""
    obj = json.loads(raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("custom_id"), str):
        raise ValueError("each line must be an object with a custom_id string")
    if obj.get("method", "POST") != "POST" or obj.get("url") != endpoint:
        raise ValueError(f"each line must be a POST to the batch's endpoint {endpoint}")
    if not isinstance(obj.get("body"), dict):
        raise ValueError("each line needs a body object")
    return obj["custom_id"], obj["body"]


async def advance(gw: Gateway, batch_id: str) -> None:
    """One round of progress (see the module docstring); a no-op while another gateway holds the batch."""
    client = gw.store.client
    lock = f"{batch_key(batch_id)}:lock"
    if not await client.set(lock, gw.settings.instance_id, nx=True, px=_LOCK_MS):
        return
    try:
        record = {str(k): str(v) for k, v in (await client.hgetall(batch_key(batch_id))).items()}
        if not record or record.get("status") in FINISHED:
            await client.srem(active_key(gw), batch_id)
            return
        if record.get("topic") != gw.settings.kafka_topic:
            return  # another deployment's batch (one Redis, two topics): its own gateways carry it
        if record["status"] == "in_progress" and time.time() > float(record["expires_at"]):
            # The completion window has passed: what has not finished by now is not run.
            await stop(gw, batch_id, expiring=True)
            # As stored by stop(): lines not yet taken end at once, so this very round may finish the
            # batch, and it must finish as "expired", not "cancelled".
            record.update(status="cancelling", expiring="1")
        if record["status"] == "in_progress":
            await _submit(gw, record)
        await _count_and_finish(gw, record)
    finally:
        await client.delete(lock)


async def stop(gw: Gateway, batch_id: str, *, expiring: bool = False) -> None:
    """No more lines are submitted and the unfinished jobs are cancelled (a cancel, or the window's end);
    the batch is "cancelled" (or "expired") once they have all ended."""
    client = gw.store.client
    fields: dict[str, str | int | float] = {
        "status": "cancelling",
        "cancelling_at": int(time.time()),
        "expiring": int(expiring),
    }
    await gw.store.update_existing(batch_key(batch_id), fields)
    for raw in await client.lrange(lines_key(batch_id), 0, -1):
        job_id = json.loads(raw).get("job")
        if job_id:
            await gw.dispatcher.cancel(job_id)


async def _num_queued(gw: Gateway, record: dict[str, str]) -> int:
    """The batch's lines submitted and not yet taken by a worker. Lines are taken about in order, so only
    those from ``queued_from`` (the first line that may still be queued) on are looked at, and it moves
    past the lines taken since. Worked example: lines 0-9 submitted, 0-5 and 7 taken: 6, 8 and 9 are
    queued and ``queued_from`` becomes 6."""
    client = gw.store.client
    batch_id, cursor = record["id"], int(record["cursor"])
    low = int(record.get("queued_from") or 0)
    pipe = client.pipeline(transaction=False)
    for index in range(low, cursor):
        pipe.hget(keys.record(line_job_id(batch_id, index)), "status")
    queued = [str(s or "") == QUEUED for s in await pipe.execute()]
    moved = next((i for i, q in enumerate(queued) if q), len(queued))
    if moved:
        await gw.store.update_existing(batch_key(batch_id), {"queued_from": low + moved})
        record["queued_from"] = str(low + moved)
    return sum(queued)


def pace_credit(record: dict[str, str], rate: float, now: float) -> float:
    """Lines the batch may submit now: a token bucket filled at ``rate`` lines a second since the last
    round that submitted, holding two sweeps' share and a line (rounds come later than ``SWEEP_S`` by
    their own work, and the fraction they bring must carry over), so neither a pause nor clients reading
    the batch often (a read advances it too) lets a burst through. Worked example, rate 16: a round 0.2 s
    after the last may submit 3.2 -> 3 lines, and the 0.2 left carries over."""
    ceiling = 2 * rate * SWEEP_S + 1
    if "paced_at" not in record:
        return ceiling
    elapsed = max(0.0, now - float(record["paced_at"]))
    return min(ceiling, float(record.get("pace_credit") or 0) + rate * elapsed)


async def _submit(gw: Gateway, record: dict[str, str]) -> None:
    """Submit lines from the cursor, at the batch's pace (``pace_credit``), until ``batch_max_queued`` of
    them wait to be taken (or the cluster is at capacity). The broker then holds few of the batch's lines
    ahead of interactive requests, and the lines a worker has taken wait in its engine, where background
    work waits behind the rest."""
    client = gw.store.client
    batch_id, endpoint = record["id"], record["endpoint"]
    cursor, total = int(record["cursor"]), int(record["total"])
    if cursor >= total:
        return
    now = time.time()
    credit = pace_credit(record, gw.settings.batch_max_queued, now)
    room = min(int(credit), gw.settings.batch_max_queued - await _num_queued(gw, record))
    if room <= 0:
        return
    stop = min(total, cursor + min(room, _SUBMIT_PER_ROUND))
    lines = await read_lines(client, batch_id, record["input_file_id"], cursor, stop)
    for index, raw in zip(range(cursor, stop), lines, strict=True):
        entry = await _submit_line(gw, record, index, raw, endpoint)
        if entry is None:
            break  # at capacity (or the broker is down): the next round goes on from here
        credit -= 1
        pace: dict[str, str | int | float] = {
            "cursor": index + 1,
            "paced_at": f"{now:.6f}",
            "pace_credit": f"{credit:.6f}",
        }
        pipe = client.pipeline(transaction=True)
        pipe.rpush(lines_key(batch_id), json.dumps(entry))
        pipe.expire(lines_key(batch_id), 2 * gw.settings.job_ttl_s)  # as long as the batch record
        pipe.eval(*_eval_args(gw.store.update_existing_call(batch_key(batch_id), pace)))
        await pipe.execute()
        record.update({k: str(v) for k, v in pace.items()})


async def _submit_line(
    gw: Gateway, record: dict[str, str], index: int, raw: str, endpoint: str
) -> dict[str, Any] | None:
    """The line's entry once it is a job (or refused); None to retry it later."""
    batch_id = record["id"]
    custom_id: Any = None
    try:
        custom_id, body = parse_line(raw, endpoint)
    except ValueError as exc:  # json's errors are ValueErrors too
        error = {"error": {"code": "invalid_request", "message": f"line {index + 1}: {exc}"}}
        return {"custom_id": None, "error": _line_error(index, None, None, error)}
    job_id = line_job_id(batch_id, index)
    if await gw.store.client.exists(keys.record(job_id)):
        return {"custom_id": custom_id, "job": job_id}  # produced by a round that died before its cursor
    try:
        kind, prepared, tools = await prepare_job(gw, endpoint, body)
        prepared = dataclasses.replace(prepared, priority=max(prepared.priority, BATCH_PRIORITY))
        extra: dict[str, str | int | float] = {
            "endpoint": endpoint,
            "metadata": "{}",
            "owner": record["owner"],
            "tools": tools or "",
            "batch": batch_id,
            **tool_reading(prepared),
        }
        await gw.enqueue(
            kind, prepared, job=True, subscribe=False, extra=extra, request_id=job_id, owner=record["owner"]
        )
    except APIError as exc:
        if exc.status in (429, 503):
            return None
        return {"custom_id": custom_id, "error": _line_error(index, custom_id, exc.status, exc.body())}
    return {"custom_id": custom_id, "job": job_id}


async def _entries(client: Redis, batch_id: str, start: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The line entries from line ``start`` on, and each one's job status ("" for a refused line)."""
    entries = [json.loads(e) for e in await client.lrange(lines_key(batch_id), start, -1)]
    pipe = client.pipeline(transaction=False)
    for e in entries:
        pipe.hget(keys.record(e.get("job") or "-"), "status")
    return entries, [str(s or "") for s in await pipe.execute()]


@dataclasses.dataclass
class Tally:
    """request_counts, and how far the lines that have all ended reach (``ended_below``) with their counts.

    Lines end about in the order they were taken, and an ended line's status never changes, so the record
    keeps the counts of the lines below ``ended_below`` and a round reads the statuses of the lines from
    there on only: about the lines in flight, not the whole batch. Worked example: lines 0-9 taken, 0-5
    and 7 ended: the round reads 0-9 once, and the record then counts 0-5 and reads from 6 on."""

    counts: dict[str, int]
    ended_below: int
    ended_completed: int
    ended_failed: int
    all_ended: bool  # every line taken so far has ended


async def tally(client: Redis, record: dict[str, str]) -> Tally:
    low = int(record.get("ended_below") or 0)
    completed, failed = int(record.get("ended_completed") or 0), int(record.get("ended_failed") or 0)
    entries, statuses = await _entries(client, record["id"], low)
    done = [not e.get("job") or s in TERMINAL for e, s in zip(entries, statuses, strict=True)]
    good = [bool(e.get("job")) and s == COMPLETED for e, s in zip(entries, statuses, strict=True)]
    prefix = next((i for i, d in enumerate(done) if not d), len(done))
    counts = {
        "total": int(record["total"]),
        "completed": completed + sum(good),
        "failed": failed + sum(d and not g for d, g in zip(done, good, strict=True)),
    }
    return Tally(
        counts,
        low + prefix,
        completed + sum(good[:prefix]),
        failed + prefix - sum(good[:prefix]),
        prefix == len(done),
    )


async def _job_records(client: Redis, entries: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Each entry's job record ({} for a refused line or a record gone), read in pipelined chunks: one
    round trip per _READ_CHUNK lines rather than one per line."""
    out: list[dict[str, str]] = []
    for start in range(0, len(entries), _READ_CHUNK):
        pipe = client.pipeline(transaction=False)
        for e in entries[start : start + _READ_CHUNK]:
            pipe.hgetall(keys.record(e.get("job") or "-"))
        out += [{str(k): str(v) for k, v in rec.items()} for rec in await pipe.execute()]
    return out


async def counts_of(gw: Gateway, record: dict[str, str]) -> dict[str, int]:
    """The batch's request_counts now, from its record as just read."""
    return (await tally(gw.store.client, record)).counts


async def _count_and_finish(gw: Gateway, record: dict[str, str]) -> None:
    client = gw.store.client
    batch_id = record["id"]
    now = await tally(client, record)
    await gw.store.update_existing(
        batch_key(batch_id),
        {
            "request_counts": json.dumps(now.counts),
            "ended_below": now.ended_below,
            "ended_completed": now.ended_completed,
            "ended_failed": now.ended_failed,
        },
    )
    cancelling = record["status"] == "cancelling"
    submitted_all = int(record["cursor"]) >= int(record["total"])
    if not (submitted_all or cancelling) or not now.all_ended:
        return
    # Once, for the output files: each line's job record holds its status too.
    entries = [json.loads(e) for e in await client.lrange(lines_key(batch_id), 0, -1)]
    jobs = await _job_records(client, entries)
    await gw.store.update_existing(batch_key(batch_id), {"finalizing_at": int(time.time())})
    output, errors = [], []
    for index, (entry, job) in enumerate(zip(entries, jobs, strict=True)):
        if "error" in entry:
            errors.append(entry["error"])
            continue
        status = job.get("status", "")
        body = response_from_record(job, entry["job"]) if status == COMPLETED else None
        if body is not None:
            response = {"status_code": 200, "request_id": entry["job"], "body": body}
            output.append(
                json.dumps(
                    {
                        "id": f"batch_req_{index}",
                        "custom_id": entry["custom_id"],
                        "response": response,
                        "error": None,
                    }
                )
            )
        else:
            error = {
                "error": {
                    "message": job.get("error") or f"the request ended {status or 'expired'}",
                    "type": "server_error",
                    "param": None,
                    "code": job.get("code") or status or "expired",
                }
            }
            errors.append(_line_error(index, entry["custom_id"], 500, error))
    ttl_s, owner = gw.settings.job_ttl_s, record["owner"]
    status = ("expired" if record.get("expiring") == "1" else "cancelled") if cancelling else COMPLETED
    fields: dict[str, str | int] = {"status": status, f"{status}_at": int(time.time())}
    if output:
        out = await store_file(
            gw, owner, f"{batch_id}_output.jsonl", "batch_output", "\n".join(output).encode() + b"\n", ttl_s
        )
        fields["output_file_id"] = out["id"]
    if errors:
        err = await store_file(
            gw, owner, f"{batch_id}_error.jsonl", "batch_output", "\n".join(errors).encode() + b"\n", ttl_s
        )
        fields["error_file_id"] = err["id"]
    pipe = client.pipeline(transaction=True)
    pipe.hset(batch_key(batch_id), mapping=cast(Any, fields))
    pipe.expire(batch_key(batch_id), ttl_s)
    pipe.expire(lines_key(batch_id), ttl_s)
    pipe.delete(index_key(batch_id))  # no line is read again
    pipe.srem(active_key(gw), batch_id)
    await pipe.execute()
