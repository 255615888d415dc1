"""The ``inflight`` command: one subcommand per module in ``inflight/commands``.

Adding a subcommand is adding a module there that defines ``NAME``, ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int``, and naming it in ``COMMANDS`` below. Modules import their heavy dependencies (torch,
FastAPI, plotting) inside ``run``, so ``inflight --help`` stays fast and runs in the torch-free gateway
image.
The benchmarks are not a subcommand: they live in the repository's ``bench/`` tree (``python -m bench``),
which the installed package neither carries nor imports.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

# Subcommand name -> module, in the order ``--help`` lists them.
COMMANDS: dict[str, str] = {
    "gateway": "inflight.commands.gateway",
    "worker": "inflight.commands.worker",
    "dev": "inflight.commands.dev",
    "plan": "inflight.commands.plan",
}


def _module(name: str) -> ModuleType:
    return importlib.import_module(COMMANDS[name])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inflight", description="Continuous-batching LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = _module(name)
        module.add_arguments(sub.add_parser(name, help=module.HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    return int(_module(args.command).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
