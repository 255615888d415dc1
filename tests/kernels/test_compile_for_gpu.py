"""The Triton kernels pass Triton's real code generator for sm_90 (see aot_compile.py), on a host
with no GPU: what the interpreter cannot catch before a GPU is lent. Where a GPU exists the kernel
tests compile and run the same kernels on it, so this is skipped there."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _has_cuda_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU compiles and runs the kernels itself")
def test_kernels_compile_for_sm90(tmp_path: Path) -> None:
    if not _has_cuda_backend():
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kernels" / "aot_compile.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # 10 float-cache variants, 4 of attention over 8-bit caches, 2 of the quantizing KV store, 4 of the
    # per-channel 8-bit linear (int8 and fp8 codes, two tiles each).
    assert proc.stdout.count("ok   ") == 20 and "FAIL" not in proc.stdout, proc.stdout
