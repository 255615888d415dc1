"""``python -m bench ...``: the benchmarks and the planner's research instruments, run from the
repository root (bench/ is not installed: it imports engine, services and inflight, never the reverse).

python -m bench engine    the seed's experiment: continuous vs static vs HF peers (make bench)
python -m bench sweep     any targets over a range of request rates, Poisson / gamma / trace
python -m bench peers     this engine vs vLLM's CPU backend, same workload, dtype and threads
python -m bench llamacpp  this engine vs llama.cpp on the same GGUF files: perplexity, batch 1, bursts
python -m bench memory    resident memory quantized vs float32, and the largest model a host fits
python -m bench trace     Chrome/Perfetto trace (and timelines) from saved run JSON files
python -m bench service   the full service path (bench/service_bench.py)
python -m bench serve     the stack beside `vllm serve`, both driven by `vllm bench serve` (serve_bench.py)
python -m bench chaos     fault-injection soak of the service path (bench/chaos.py, make chaos)
python -m bench host      how steady this host's speed is (bench/host_drift.py)
python -m bench policies  the scheduling policies measured on the real engine (bench/policy_bench.py)
python -m bench validate  plan validate with repeats, host drift or the service path (bench/plan_validate.py)
python -m bench core-cpu  the engine core process's CPU per generated token (bench/core_cpu.py)
python -m bench kv-dtype  accuracy of the 8-bit KV caches on the shipped model (bench/kv_dtype.py)
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from bench import (
    core_cpu,
    experiment,
    host_drift,
    kv_dtype,
    llamacpp,
    memory,
    peers,
    plan_validate,
    policy_bench,
    sweep,
)


def _trace_command(args: argparse.Namespace) -> int:
    from bench.results import RunResult, write_json
    from bench.timeline import chrome_trace, request_timelines

    runs = [RunResult.from_json(json.loads(Path(p).read_text())) for p in args.runs]
    Path(args.trace_out).write_text(json.dumps(chrome_trace(runs)))
    if args.timelines_out:
        write_json(args.timelines_out, {f"{r.target} {r.label}": request_timelines(r) for r in runs})
    print(f"wrote {args.trace_out} ({len(runs)} runs)")
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    experiment.add_arguments(sub.add_parser("engine", help="continuous vs static batching vs HF"))
    sweep.add_arguments(sub.add_parser("sweep", help="rate sweep over any targets"))
    peers.add_arguments(sub.add_parser("peers", help="this engine vs vLLM's CPU backend, side by side"))
    llamacpp.add_arguments(
        sub.add_parser(
            "llamacpp", help="this engine vs llama.cpp on the same GGUF files (make bench-llamacpp)"
        )
    )
    memory.add_arguments(sub.add_parser("memory", help="resident memory by weight format; what fits a host"))
    t = sub.add_parser("trace", help="Chrome/Perfetto trace from saved runs (out/runs/*.json)")
    t.add_argument("runs", nargs="+", help="run JSON files written by engine or sweep")
    t.add_argument("--trace-out", required=True)
    t.add_argument("--timelines-out", help="also write per-request timelines joined with steps")
    sub.add_parser(
        "service", help="the full service path (arguments go to bench/service_bench.py)", add_help=False
    )
    sub.add_parser("chaos", help="fault-injection soak (arguments go to bench/chaos.py)", add_help=False)
    sub.add_parser(
        "serve",
        help="the stack beside `vllm serve`, both driven by vLLM's client (bench/serve_bench.py)",
        add_help=False,
    )
    sub.add_parser(
        "batch-interference",
        help="interactive TTFT with and without a batch running (bench/batch_interference.py)",
        add_help=False,
    )
    host_drift.add_arguments(sub.add_parser("host", help="how steady this host's speed is, core by core"))
    policy_bench.add_arguments(sub.add_parser("policies", help="fcfs vs priority vs slo on the real engine"))
    plan_validate.add_arguments(
        sub.add_parser("validate", help="plan validate with --repeats, --host-drift or --service")
    )
    core_cpu.add_arguments(
        sub.add_parser("core-cpu", help="the engine core process's CPU per generated token")
    )
    kv_dtype.add_arguments(
        sub.add_parser(
            "kv-dtype", help="accuracy of the int8 / fp8_e4m3 KV caches on the shipped model and text"
        )
    )
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["service"]:
        # The service benchmark owns its own arguments: hand them over untouched.
        # Imported by name: another module owns it, and it pulls in the service stack.
        service_bench = importlib.import_module("bench.service_bench")
        return int(service_bench.main(argv[1:]) or 0)
    if argv[:1] == ["batch-interference"]:
        # Starts servers and services: imported on demand, and owns its arguments.
        batch_interference = importlib.import_module("bench.batch_interference")
        return int(batch_interference.main(argv[1:]))
    if argv[:1] == ["serve"]:
        # Starts both servers and vLLM's client: imported on demand, and owns its arguments.
        serve_bench = importlib.import_module("bench.serve_bench")
        return int(serve_bench.main(argv[1:]))
    if argv[:1] == ["chaos"]:
        chaos = importlib.import_module("bench.chaos")  # starts servers and services: imported on demand
        return int(chaos.main(argv[1:]))
    args = _parser().parse_args(argv)
    args.argv = argv[1:]
    if args.command == "engine":
        return experiment.run(args)
    if args.command == "sweep":
        return sweep.run(args)
    if args.command == "peers":
        return peers.main(args)
    if args.command == "llamacpp":
        return llamacpp.main(args)
    if args.command == "memory":
        return memory.main(args)
    if args.command == "host":
        return host_drift.main(args)
    if args.command == "policies":
        return policy_bench.main(args)
    if args.command == "validate":
        return plan_validate.main(args)
    if args.command == "core-cpu":
        return core_cpu.main(args)
    if args.command == "kv-dtype":
        return kv_dtype.main(args)
    return _trace_command(args)


if __name__ == "__main__":
    raise SystemExit(main())
