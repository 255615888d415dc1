"""``inflight dev``: broker, Redis, worker(s) and gateway on loopback, in one command."""

from __future__ import annotations

import argparse

NAME = "dev"
HELP = "broker, Redis, worker(s) and gateway on loopback, in one command"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8000, help="gateway port (default 8000)")
    parser.add_argument(
        "--model", help="HF checkpoint directory or .gguf file (default: SmolLM2-135M-Instruct, GGUF)"
    )
    parser.add_argument(
        "--served-model-name",
        help="the id clients send as 'model' (default INFLIGHT_SERVED_MODEL_NAME, else the checkpoint's "
        "short name, e.g. smollm2-135m-instruct)",
    )
    parser.add_argument("--workers", type=int, default=1, help="number of worker processes (default 1)")


def run(args: argparse.Namespace) -> int:
    from services.dev import main as dev_main

    return dev_main(
        port=args.port, model=args.model, num_workers=args.workers, served_model_name=args.served_model_name
    )
