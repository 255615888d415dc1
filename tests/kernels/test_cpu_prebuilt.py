"""CPU kernels built ahead of time (a worker image's build step) load where nothing can be built.

The build here is the host's own (``make setup`` made it; otherwise this test builds it once). Its
library and stamp are copied alone into a fresh kernel folder, and a process with neither a compiler nor
ninja on its PATH loads them from there: it must take the prebuilt library as it is, leaving no lock or
build file behind (an image's root filesystem is read-only), rather than fall back to the torch path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels import cpu
from engine.paths import CPU_EXT_ENV

_LOAD = (
    "from engine.kernels import cpu; import torch; "
    "print(cpu.load(), hasattr(torch.ops.inflight_cpu, 'rms_norm'))"
)


@pytest.mark.timeout(900)
def test_a_stamped_build_loads_without_a_compiler(tmp_path: Path) -> None:
    if not cpu.load():
        pytest.skip("this host cannot build the CPU kernels")
    built = cpu.build_dir()
    assert (built / cpu.BUILT_STAMP).is_file()  # a finished build says so
    target = tmp_path / "cpu_ext" / built.name
    target.mkdir(parents=True)
    for name in (cpu.BUILT_STAMP, "inflight_cpu.so"):
        shutil.copy2(built / name, target / name)
    bare_bin = tmp_path / "bin"  # an empty PATH: no g++, no ninja
    bare_bin.mkdir()
    env = {**os.environ, CPU_EXT_ENV: str(tmp_path / "cpu_ext"), "PATH": str(bare_bin)}
    out = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"], out.stderr  # loaded, and its ops registered
    assert sorted(p.name for p in target.iterdir()) == sorted([cpu.BUILT_STAMP, "inflight_cpu.so"])
