"""``inflight gateway``: the OpenAI-compatible HTTP gateway."""

from __future__ import annotations

import argparse
import dataclasses

NAME = "gateway"
HELP = "the OpenAI-compatible HTTP gateway (settings: INFLIGHT_* env)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, help="listen port (default INFLIGHT_GATEWAY_PORT, 8000)")
    parser.add_argument("--host", help="bind address (default INFLIGHT_BIND_HOST, 0.0.0.0)")


def run(args: argparse.Namespace) -> int:
    from services.common.settings import get_settings
    from services.gateway.main import main as gateway_main

    settings = get_settings()
    if args.host:
        settings = dataclasses.replace(settings, bind_host=args.host)
    gateway_main(settings, port=args.port)
    return 0
