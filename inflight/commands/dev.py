"""``inflight dev``: broker, Redis, worker(s) and gateway on loopback, in one command.

The loopback stack lives in the repository's ``harness/`` package, which the wheel does not install:
this command runs from a source checkout (``make run``), and says so anywhere else.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

NAME = "dev"
HELP = "broker, Redis, worker(s) and gateway on loopback, in one command (from a source checkout)"

NOT_A_CHECKOUT = (
    "inflight dev runs from a source checkout of inflight: the loopback stack (harness/) is not part of "
    "the installed package. Clone the repository and run `make run` there."
)


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


def checkout_root() -> Path | None:
    """The source checkout this ``inflight`` package was loaded from, if it was loaded from one (an
    editable install maps the package into the checkout; a wheel puts it in site-packages)."""
    import inflight

    root = Path(inflight.__file__).resolve().parent.parent
    found = (root / "harness" / "__init__.py").is_file() and (root / "pyproject.toml").is_file()
    return root if found else None


def load_harness() -> ModuleType | None:
    """``harness.dev``, found on sys.path or in the checkout; None where neither has it."""
    try:
        return importlib.import_module("harness.dev")
    except ModuleNotFoundError as exc:
        if exc.name not in ("harness", "harness.dev"):
            raise  # the harness is there but something it needs is not: that is a real error
    root = checkout_root()
    if root is None:
        return None
    # The editable install's finder maps only the packages the wheel carries, so the console script
    # does not see harness/ beside them; the checkout root on sys.path does.
    sys.path.insert(0, str(root))
    return importlib.import_module("harness.dev")


def run(args: argparse.Namespace) -> int:
    dev = load_harness()
    if dev is None:
        print(NOT_A_CHECKOUT, file=sys.stderr)
        return 2
    return int(
        dev.main(
            port=args.port,
            model=args.model,
            num_workers=args.workers,
            served_model_name=args.served_model_name,
        )
    )
