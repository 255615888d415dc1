"""Session-wide test setup."""

from __future__ import annotations

import os

# Triton kernels run under the interpreter on hosts without CUDA. Set before anything imports
# triton: pytest may collect tests/engine (which can import engine.kernels) before tests/kernels.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # the gateway-only environment has no torch
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's token-exact checks compare against float32 references (HF transformers in float32, an
# undisturbed run of the same engine), so `dtype="auto"` resolves to float32 here on every host, in this
# process and in the workers it spawns. bf16 is tested where a test asks for it by name.
os.environ.setdefault("INFLIGHT_CPU_AUTO_DTYPE", "float32")
