"""``inflight worker``: an engine worker (Kafka consumer -> engine -> Redis)."""

from __future__ import annotations

import argparse
import dataclasses

NAME = "worker"
HELP = "an engine worker: Kafka consumer -> engine -> Redis"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, help="probe/metrics port (default INFLIGHT_WORKER_PORT, 8001)")
    parser.add_argument(
        "--model", help="model directory or .gguf file (default INFLIGHT_MODEL; required), or tiny-random"
    )


def run(args: argparse.Namespace) -> int:
    from services.common.settings import get_settings
    from services.worker.main import main as worker_main

    overrides = {k: v for k, v in (("worker_port", args.port), ("model", args.model)) if v is not None}
    worker_main(dataclasses.replace(get_settings(), **overrides))
    return 0
