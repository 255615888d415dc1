"""The ``inflight`` command: ``gateway``, ``worker``, ``dev`` (the local stack) and ``bench``."""

from __future__ import annotations

import argparse
import dataclasses
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description="Continuous-batching LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    gateway = sub.add_parser("gateway", help="the OpenAI-compatible HTTP gateway (settings: INFLIGHT_* env)")
    gateway.add_argument("--port", type=int, help="listen port (default INFLIGHT_GATEWAY_PORT, 8000)")
    gateway.add_argument("--host", help="bind address (default INFLIGHT_BIND_HOST, 0.0.0.0)")
    worker = sub.add_parser("worker", help="an engine worker: Kafka consumer -> engine -> Redis")
    worker.add_argument("--port", type=int, help="probe/metrics port (default INFLIGHT_WORKER_PORT, 8001)")
    worker.add_argument("--model", help="model directory (default INFLIGHT_MODEL, else the tiny model)")
    dev = sub.add_parser("dev", help="broker, Redis, worker(s) and gateway on loopback, in one command")
    dev.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    dev.add_argument("--model", help="model directory (default: the tiny random-weight model)")
    dev.add_argument("--workers", type=int, default=1, help="number of worker processes (default 1)")
    sub.add_parser("bench", help="benchmarks: inflight bench --help", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # bench owns its arguments (--help included): hand them over untouched, importing it lazily
        # since it pulls in plotting and workloads.
        from bench.cli import main as bench_main

        return int(bench_main(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    if args.command == "dev":
        from services.dev import main as dev_main

        return dev_main(port=args.port, model=args.model, num_workers=args.workers)

    from services.common.settings import get_settings

    settings = get_settings()
    if args.command == "gateway":
        from services.gateway.main import main as gateway_main

        if args.host:
            settings = dataclasses.replace(settings, bind_host=args.host)
        gateway_main(settings, port=args.port)
        return 0
    from services.worker.main import main as worker_main

    overrides = {k: v for k, v in (("worker_port", args.port), ("model", args.model)) if v is not None}
    worker_main(dataclasses.replace(settings, **overrides))
    return 0


if __name__ == "__main__":
    sys.exit(main())
