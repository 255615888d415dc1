"""vLLM's CPU backend replaying workloads: run with ``.venv-peers/bin/python`` (see vllm_cpu.py).

This file runs inside vLLM's own virtualenv, so it imports nothing of this project: only the standard
library and vllm. It is a long-lived child of the ``vllm`` target that speaks one JSON object per
line:

    stdin line 1   the engine config: model, dtype, max_num_seqs, max_num_batched_tokens, block_size,
                   max_model_len, num_blocks, seed, eager
    reply          {"ready": true, "vllm_version": ...}
    stdin          {"op": "run", "prefix": "warmup-", "requests": [{request_id, arrival,
                   prompt_token_ids, max_tokens}, ...]}   (sorted by arrival)
    reply          {"requests": [{request_id, token_times, output_token_ids, finished, error}, ...],
                    "wall_s": ..., "cpu_s": CPU seconds of the driver and vLLM's processes}
    stdin          {"op": "close"}

Replies go to the original stdout; everything else that writes to stdout (vLLM's loggers, its engine
core and worker processes, which inherit the descriptor) is moved to stderr, so a stray print can
never corrupt the protocol. vLLM starts its engine core with multiprocessing "spawn", which re-imports
this file in the child: hence the ``__main__`` guard.

The replay is the one the in-process engine target does: before each step, every request whose
arrival time has passed is added; each step's new tokens are stamped with the time step() returned.
Times are seconds from the replay's start.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, TextIO

# Python puts this file's directory first on sys.path, where engine.py, hf.py (and any module that
# happens to share a name with one of vLLM's imports) would shadow the real ones. vLLM's spawned
# processes inherit sys.path, so this one line covers them too.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]


def build_engine(cfg: dict[str, Any]) -> Any:
    from vllm import EngineArgs, LLMEngine

    args = EngineArgs(
        model=cfg["model"],
        dtype=cfg["dtype"],
        max_num_seqs=cfg["max_num_seqs"],
        max_num_batched_tokens=cfg["max_num_batched_tokens"],
        block_size=cfg["block_size"],
        max_model_len=cfg["max_model_len"],
        # vLLM's block pool holds one block back as its null block: one more gives the usable
        # capacity the target asked for.
        num_gpu_blocks_override=cfg["num_blocks"] + 1,
        enable_prefix_caching=False,
        enable_chunked_prefill=True,
        enforce_eager=cfg["eager"],
        seed=cfg["seed"],
        disable_log_stats=True,
    )
    return LLMEngine.from_engine_args(args)


def replay(engine: Any, requests: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    records = {
        prefix + r["request_id"]: {
            "request_id": r["request_id"],
            "token_times": [],
            "output_token_ids": [],
            "finished": None,
            "error": None,
        }
        for r in requests
    }
    cpu_before = _cpu_seconds()
    started = time.time()
    t0 = time.monotonic()
    i = 0
    while i < len(requests) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while i < len(requests) and requests[i]["arrival"] <= now:
            r = requests[i]
            # Greedy with EOS ignored: exactly max_tokens each, as every target generates.
            params = SamplingParams(
                max_tokens=r["max_tokens"],
                temperature=0.0,
                ignore_eos=True,
                output_kind=RequestOutputKind.DELTA,  # each step returns only its new tokens
            )
            engine.add_request(
                prefix + r["request_id"],
                TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"])),
                params,
                arrival_time=started + r["arrival"],  # vLLM keeps arrivals on the wall clock
            )
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, requests[i]["arrival"] - now))
            continue
        outputs = engine.step()
        t = time.monotonic() - t0
        for out in outputs:
            rec = records[out.request_id]
            for c in out.outputs:
                rec["output_token_ids"].extend(c.token_ids)
                rec["token_times"].extend([t] * len(c.token_ids))
            if out.finished:
                rec["finished"] = t
    wall = time.monotonic() - t0
    return {"requests": list(records.values()), "wall_s": wall, "cpu_s": _cpu_seconds() - cpu_before}


def _cpu_seconds() -> float:
    """CPU seconds of this process and its live descendants (vLLM's engine core and worker do the
    work; they live as long as the engine, so a difference of two readings is the replay's cost)."""
    import psutil  # a dependency of vllm

    me = psutil.Process()
    total = 0.0
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def _reply(proto: TextIO, obj: dict[str, Any]) -> None:
    proto.write(json.dumps(obj) + "\n")
    proto.flush()


def main() -> int:
    # Keep the real stdout for replies; point descriptor 1 at stderr for everything else.
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    cfg = json.loads(sys.stdin.readline())
    try:
        import vllm

        engine = build_engine(cfg)
    except Exception:
        _reply(proto, {"error": traceback.format_exc()})
        return 1
    _reply(proto, {"ready": True, "vllm_version": vllm.__version__})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "close":
            break
        try:
            _reply(proto, replay(engine, cmd["requests"], cmd.get("prefix", "")))
        except Exception:
            _reply(proto, {"error": traceback.format_exc()})
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
