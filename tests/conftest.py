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
