"""``python -m bench.idle_cpu``: what an idle stack costs, with the worker's idle long poll and without.

Starts the loopback stack (tiny model; its own broker and Redis) once per idle fetch wait
(``INFLIGHT_KAFKA_IDLE_FETCH_WAIT_MS``; 0 = the busy 5 ms fetch for ever), lets it sit idle past the
worker's switch to the long poll, then reads each process group's CPU over ``--seconds`` of idleness
(bench/process_cpu.py). Prints cores kept busy per group and writes ``idle_cpu.json``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.process_cpu import REST, THIS_PROCESS, CpuMeter, stack_processes
from bench.results import write_json
from services.worker.fetch_wait import IDLE_AFTER_S


def measure(wait_ms: int, seconds: float) -> dict[str, float]:
    from engine.models.tiny import default_model_path
    from harness.stack import build_stack

    with tempfile.TemporaryDirectory(prefix="inflight-idle-") as tmp:
        env = {"INFLIGHT_KAFKA_IDLE_FETCH_WAIT_MS": str(wait_ms), "INFLIGHT_TORCH_THREADS": "1"}
        stack = build_stack(default_model_path(), Path(tmp), env=env)
        try:
            time.sleep(IDLE_AFTER_S + 3.0)  # past the switch, and past the start-up's own work
            meter = CpuMeter(stack_processes(stack))
            time.sleep(seconds)
            cores = meter.cores()
        finally:
            stack.close()
    return {k: v for k, v in cores.items() if k not in (THIS_PROCESS, REST)}


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench.idle_cpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--waits", default="0,500", help="idle fetch waits in ms (0: none)")
    p.add_argument("--out", default="bench-results")
    args = p.parse_args()
    results: dict[str, Any] = {}
    for wait in [int(w) for w in args.waits.split(",")]:
        cores = measure(wait, args.seconds)
        results[str(wait)] = cores
        line = ", ".join(f"{k} {v * 1000:.1f}" for k, v in cores.items())
        print(
            f"idle fetch wait {wait} ms: millicores {line}; total {sum(cores.values()) * 1000:.1f}",
            flush=True,
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    write_json(Path(args.out) / "idle_cpu.json", {"seconds": args.seconds, "cores": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
