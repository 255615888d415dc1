"""Run one consumed request through the engine: claim, resume, generate, finish.

    take (no longer pending) -> start (lease, seed, the log so far) -> generate each completion index
    -> finish (last event + record, lease dropped), or hand back / stop when fenced. A run whose
    engine died under it once too often (poison.py) is failed instead of handed back; one an engine died
    under before runs alone on its engine (quarantine.py).

A request with n completions is one engine request: the engine fans it out (seeds seed + i); after a
crash each index resumes from its own tokens in the log, and indexes already finished are not run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from opentelemetry import trace

from engine.core.client import EngineClient
from engine.inputs import EngineRequest, prepare_prompt
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParams
from services.common.engine_spans import EngineSpanExporter
from services.common.metrics import service_families
from services.common.settings import Settings
from services.common.store import Store
from services.common.wire import (
    CANCELLED,
    COMPLETED,
    FAILED,
    DeltaEvent,
    DoneEvent,
    encode_event,
    prompt_logprobs_json,
)
from services.worker.lifecycle import RunEvent, RunStatus
from services.worker.poison import fail_if_poison, failed_before
from services.worker.publisher import Publisher
from services.worker.quarantine import Quarantine
from services.worker.requeue import Requeue
from services.worker.run_state import Final, Outcome, PendingDelta, Run, record
from services.worker.worker_telemetry import count_cancelled, engine_attributes

log = logging.getLogger(__name__)


class Runner:
    def __init__(
        self,
        engine: EngineClient,
        store: Store,
        publisher: Publisher,
        settings: Settings,
        spans: EngineSpanExporter | None = None,
        quarantine: Quarantine | None = None,
        requeue: Requeue | None = None,
    ) -> None:
        self.engine = engine
        # Who may be in the engine beside whom: a run an engine died under goes alone (quarantine.py).
        self.quarantine = quarantine or Quarantine()
        self.requeue = requeue or Requeue(settings)
        self.store = store
        self.publisher = publisher
        self.settings = settings
        self.spans = spans  # None: the engine's requests are not traced (no exporter attached)
        self._rng = random.Random()
        # One thread: prompts prepared in turn, so a burst of long ones takes one core, never the loop's.
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="inflight-prompt")

    async def execute(self, run: Run) -> Outcome:
        s = self.settings
        ttl = s.job_ttl_s if run.msg.job else s.record_ttl_s
        if time.time() - run.msg.created > ttl:
            # Older than its record's lifetime: its record may be gone (expired, or Redis lost it), so
            # "not terminal" proves nothing and running it could run it twice. Its client has long
            # given up (a replay after an offset reset, a new consumer group, a stuck commit).
            log.warning(
                "skipping %s: %.0fs old, past its record's %ds lifetime",
                run.id,
                time.time() - run.msg.created,
                ttl,
            )
            return Outcome.SKIPPED
        while True:
            start = await self.store.start(run.id, s.worker_id, s.lease_ttl_s, self._rng.getrandbits(62), ttl)
            if start.outcome == "terminal":
                if start.status == CANCELLED:  # cancelled while still in Kafka (or a redelivery of one)
                    count_cancelled("queued")
                return Outcome.SKIPPED  # redelivered after it finished: never run twice
            if start.outcome == "ok":
                break
            # Another live worker holds it (a rebalance moved the partition while it runs): wait for it
            # to finish or for its lease to lapse (it died), never generate alongside it.
            if run.handed_back:
                return Outcome.HANDED_BACK
            await asyncio.sleep(min(1.0, s.lease_ttl_s / 4))
        run.holds_lease, run.epoch = True, start.epoch
        run.state.send(RunEvent.CLAIM)
        if any(isinstance(e, DoneEvent) for e in start.events):
            return Outcome.SKIPPED
        self._resume(run, start.events)
        if start.cancelled and run.state.send(RunEvent.CANCEL):
            count_cancelled("intake")  # cancelled before this worker claimed it; the listener counts the rest
        if run.cancelled:
            return await self._finish(run)
        if run.errors:  # the worker gave up on it after repeated failures (worker.py): fail it for good
            return await self._finish(run)
        if await failed_before(self.store, s, run):  # past the engine-failure bound already (poison.py)
            return await self._finish(run)
        deadline = run.msg.deadline
        if deadline is not None and not run.resumed_from and time.time() > deadline:
            # Nobody waits for it any more (its client's timeout, or the gateway's queue bound): fail it
            # before the engine spends a prefill on it. A resumed request has started: it runs on.
            late_s = time.time() - deadline
            log.info("skipping %s: its deadline passed %.1fs ago", run.id, late_s)
            run.state.fail(
                0, f"no engine could start this request by its deadline ({late_s:.1f}s ago)", "timeout"
            )
            return await self._finish(run)
        try:
            params = run.msg.params.to_params()
            # Text and chat messages are tokenized (and rendered) on a thread of their own: a long render
            # on this loop would stall every lease renewal, Kafka heartbeat and token publish of the worker.
            prompt = run.msg.prompt_token_ids
            if prompt:
                run.prompt_token_ids = self._prompt(run, params)
            else:
                loop = asyncio.get_running_loop()
                run.prompt_token_ids = await loop.run_in_executor(
                    self._prepare_pool, self._prompt, run, params
                )
        except Exception as exc:  # bad parameters, or a chat template that cannot render these messages
            run.state.fail(0, str(exc), "invalid_request", getattr(exc, "param", None))
            return await self._finish(run)
        seed = params.seed if params.seed is not None else start.seed
        assert seed is not None
        await self._generate(run, params, seed)
        if run.handed_back and run.state.engine_died_under and await fail_if_poison(self.store, s, run):
            return await self._finish(run)  # its engines keep dying under it: failed, not passed on
        if run.handed_back or run.fenced:
            if run.handed_back:
                await self.requeue.ensure_held(run)  # a broker that lost its log would strand it
            if run.handed_back and run.holds_lease:
                await self.store.release(run.id, s.worker_id, run.epoch)
            return Outcome.HANDED_BACK if run.handed_back else Outcome.FENCED
        return await self._finish(run)

    def _prompt(self, run: Run, params: SamplingParams) -> list[int]:
        """The prompt's token ids, prepared by the rule every edge shares (``engine.inputs``): the ids a
        tokenizing gateway sent, checked against this engine's limits, or the text or chat messages of a
        gateway without the tokenizer, tokenized here."""
        msg = run.msg
        tokenizer = self.engine.tokenizer
        limits = dataclasses.replace(self.engine.prompt_limits, max_messages=self.settings.max_messages)
        if msg.prompt_token_ids:
            return prepare_prompt(msg.prompt_token_ids, limits, tokenizer, max_tokens=params.max_tokens)
        return prepare_prompt(
            msg.prompt or "",
            limits,
            tokenizer,
            messages=msg.messages,
            add_generation_prompt=msg.add_generation_prompt,
            max_tokens=params.max_tokens,
        )

    def _resume(self, run: Run, events: list[Any]) -> None:
        """Fold what earlier workers published into this run: tokens, text, finished indexes, seq."""
        for event in sorted(events, key=lambda e: e.seq):
            if event.seq <= run.outbox.seq:
                continue  # a duplicate (a retried publish)
            assert isinstance(event, DeltaEvent)
            run.outbox.seq = event.seq
            run.outbox.logged_bytes += len(encode_event(event))
            record(
                run.output,
                PendingDelta(
                    event.index, event.token_ids, event.text, event.finish_reason, event.stop_reason
                ),
            )
        run.resumed_from = run.output.num_tokens
        if run.resumed_from:
            log.info("resuming %s after %d tokens (seq %d)", run.id, run.resumed_from, run.outbox.seq)

    async def _generate(self, run: Run, params: SamplingParams, seed: int) -> None:
        """One engine request for every completion still to run: the engine fans out (seeds seed + i),
        each index resuming from its own tokens in the log."""
        todo = []
        for index in range(params.n):
            done = run.output.choice(index).token_ids
            if run.output.finished(index):
                continue
            if params.max_tokens is not None and len(done) >= params.max_tokens:
                # The earlier worker published the last token but died before its finish: finish it here.
                self.publisher.emit(run, PendingDelta(index, [], "", "length"))
                continue
            todo.append(index)
        if not todo or run.stopping:
            return
        async with self.quarantine.enter(run.suspect):
            if run.stopping:  # cancelled, drained or its engine died while it waited for its turn
                return
            await self._run_engine(run, params, seed, todo)

    async def _run_engine(self, run: Run, params: SamplingParams, seed: int, todo: list[int]) -> None:
        resumed = {i: list(run.output.choice(i).token_ids) for i in todo}
        engine_id = run.id
        run.engine_ids.add(engine_id)
        run.state.send(RunEvent.START)
        # The engine names a child "<id>#<index>" when n > 1 (its records and spans use that name).
        child_ids = {i: engine_id if params.n == 1 else f"{engine_id}#{i}" for i in todo}
        if self.spans is not None:
            # Opened before the engine sees the request; the engine's finished records complete them.
            for i in todo:
                one = dataclasses.replace(params, n=1, seed=seed + i)
                attrs = engine_attributes(run.msg, one, i, len(resumed[i]))
                span = self.spans.start(child_ids[i], trace.set_span_in_context(run.span), attrs)
                if run.tracing.publish_parent is None:
                    run.tracing.publish_parent = trace.set_span_in_context(span)
        try:
            request = EngineRequest(
                engine_id,
                run.prompt_token_ids,
                dataclasses.replace(params, seed=seed),
                priority=run.msg.priority,
                resume_by_index=resumed if any(resumed.values()) else None,
                indexes=todo if len(todo) < params.n else None,
                slo_ttft_s=None if run.msg.slo_ttft_ms is None else run.msg.slo_ttft_ms / 1e3,
                slo_tpot_s=None if run.msg.slo_tpot_ms is None else run.msg.slo_tpot_ms / 1e3,
            )
            stream = self.engine.generate(request)
            async for out in stream:
                for c in out.outputs:
                    self._on_completion(run, params, c, out.error)
                if out.prompt_logprobs is not None:  # once, with the first tokens
                    run.prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs)
                if out.metrics is not None:  # the finished request's record: its prefix-cache hit
                    run.cached_tokens = min(out.metrics.num_cached_tokens, len(run.prompt_token_ids))
                    if run.engine_arrival is None:  # n > 1 may run as several engine requests: the first
                        run.engine_arrival = out.metrics.arrival
                        run.engine_first_token = out.metrics.first_token
                if out.error_param is not None:  # the input's fault (a grammar that did not compile): a 400
                    run.state.blame("invalid_request", out.error_param)
                if run.stopping and not out.finished:
                    await self.engine.abort(engine_id)
                elif (
                    run.outbox.logged_bytes + run.outbox.pending_bytes > self.settings.max_log_bytes
                    and not out.finished
                    and not run.log_full
                ):
                    self._log_full(run, todo)
                    await self.engine.abort(engine_id)
        except Exception as exc:
            # The engine will never report this request, so its spans end here.
            if self.spans is not None:
                for i in todo:
                    self.spans.abandon(child_ids[i], str(exc))
            if self.engine.dead_error is not None:
                # The engine died, not the request: no error event; it is handed back (offset left
                # uncommitted) and another worker resumes it from the log once this one leaves.
                log.warning("request %s handed back: the engine died", run.id)
                run.state.send(RunEvent.ENGINE_DIED)
                return
            if not isinstance(exc, ValueError | RuntimeError):
                raise
            log.warning("request %s failed: %s", run.id, exc)
            if isinstance(exc, ValueError):
                # The engine refused the input (a PromptError names the field to blame): the client's
                # fault.
                run.state.blame("invalid_request", getattr(exc, "param", None))
            for i in todo:
                if not run.output.finished(i):
                    run.state.fail(i, str(exc))
                    self.publisher.emit(run, PendingDelta(i, [], "", "error"))
        finally:
            run.engine_ids.discard(engine_id)

    def _log_full(self, run: Run, todo: list[int]) -> None:
        """The request's log passed its byte bound: its unfinished completions fail (output_too_large)
        and the caller aborts the engine request, so the log grows by at most the deltas in flight."""
        run.log_full = True
        bound = self.settings.max_log_bytes
        message = (
            f"the output passed the {bound} bytes of token events kept per request "
            "(INFLIGHT_MAX_LOG_BYTES); ask for fewer tokens, fewer completions or fewer logprobs"
        )
        for i in todo:
            if not run.output.finished(i):
                run.state.fail(i, message, "output_too_large")
        service_families().log_bound_failures.inc()
        log.warning("request %s failed: its token log passed %d bytes", run.id, bound)

    def _on_completion(
        self, run: Run, params: SamplingParams, c: CompletionOutput, error: str | None
    ) -> None:
        """One index's delta from the engine, onto the run's stream."""
        if run.first_token is None and c.token_ids:
            run.first_token = time.monotonic()
        # The text is the engine's: for a resumed stream it has replayed the earlier tokens through its
        # detokenizer, so text and stop strings continue as one uninterrupted run would.
        finish, stop_reason, text = c.finish_reason, c.stop_reason, c.text
        if finish == "abort" and (run.handed_back or run.fenced):
            return  # no event: whoever resumes continues from the log as it is
        logprobs = _logprobs(c.logprobs) if params.logprobs is not None else None
        pending = PendingDelta(c.index, list(c.token_ids), text, finish, stop_reason, logprobs)
        others_done = all(run.output.finished(i) for i in range(params.n) if i != c.index)
        self.publisher.emit(run, pending, last=finish is not None and others_done)
        if finish == "error":
            slo = (error or "").startswith("slo_ttft_unmet")  # the slo policy gave up on it
            run.state.fail(
                c.index, error or "the engine failed this request", "slo_ttft_unmet" if slo else None
            )

    async def _finish(self, run: Run) -> Outcome:
        run.state.send(RunEvent.FINISH)
        if run.status is RunStatus.CANCELLED:
            final = Final(CANCELLED, "cancelled by the client", "cancelled")
        elif run.errors:
            err = run.state
            final = Final(FAILED, "; ".join(err.errors.values()), err.error_code, param=err.error_param)
        else:
            final = Final(COMPLETED)
        final.fields = self._record_fields(run, final)
        try:
            await self.publisher.finish(run, final)
        except RuntimeError as exc:
            log.warning("could not finish %s: %s", run.id, exc)
            return Outcome.FENCED
        return Outcome.DONE

    def _record_fields(self, run: Run, final: Final) -> dict[str, str | int | float]:
        out = run.output
        n = max(len(out.choices), run.msg.params.n)
        choices = [
            {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "num_tokens": len(c.token_ids),
            }
            for i in range(n)
            for c in [out.choice(i)]
        ]
        completion_tokens = out.num_tokens
        usage = {
            "prompt_tokens": len(run.prompt_token_ids),
            "completion_tokens": completion_tokens,
            "total_tokens": len(run.prompt_token_ids) + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": run.cached_tokens},
        }
        fields: dict[str, str | int | float] = {
            "status": final.status,
            "finished": f"{time.time():.6f}",
            "kind": run.msg.kind,
            "model": run.msg.model,
            "created": f"{run.msg.created:.6f}",
            "job": int(run.msg.job),
            "result": json.dumps({"choices": choices, "prompt_logprobs": run.prompt_logprobs}),
            "usage": json.dumps(usage),
            "worker": self.settings.worker_id,
            "resumed_tokens": run.resumed_from,
        }
        if run.first_token is not None:
            fields["ttft_worker_s"] = round(run.first_token - run.started, 6)
        if run.engine_arrival is not None and run.engine_first_token is not None:
            fields["engine_arrival_s"] = round(run.engine_arrival - run.started, 6)
            fields["ttft_engine_s"] = round(run.engine_first_token - run.engine_arrival, 6)
        if final.error:
            fields["error"] = final.error
            fields["code"] = final.code or ""
        return fields


def _logprobs(raw: list[dict[int, float]] | None) -> list[list[list[float]]] | None:
    if raw is None:
        return None
    # JSON objects cannot have int keys: [token id, logprob] pairs, most likely first.
    return [sorted(([tid, lp] for tid, lp in d.items()), key=lambda p: -p[1]) for d in raw]
