"""What a fresh interpreter loads when it imports every module of some packages (the layering tests).

A fresh interpreter, so that what other tests imported cannot hide a stray import; every module, not just
the packages, since a package's ``__init__`` imports almost nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def modules_loaded_by_importing(*packages: str, timeout_s: float = 180) -> list[str]:
    script = (
        "import importlib, json, pkgutil, sys\n"
        f"for top in {packages!r}:\n"
        "    package = importlib.import_module(top)\n"
        "    for info in pkgutil.walk_packages(package.__path__, top + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded: list[str] = json.loads(done.stdout.splitlines()[-1])
    return loaded
