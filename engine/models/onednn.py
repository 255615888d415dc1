"""Linear layers on CPU through oneDNN: weights packed once, row counts padded to whole tiles.

Where the engine's own kernels run (AVX-512 without AMX: engine/models/cpu_gemm.py), oneDNN takes only
the weights they cannot; elsewhere it takes them all.

Why oneDNN for float32 too. torch's own float32 matmul is MKL's sgemm, which on a non-Intel x86 CPU
takes a slower code path: on a 2-core AMD EPYC with AVX-512, SmolLM2-135M's four linear layers x 30
at 64 rows took 172 ms through ``F.linear`` and 70 ms through oneDNN's packed weights (79 against
195 GFLOP/s; 97 against 219 at 2,048 rows), with results equal to 2e-6. oneDNN picks its kernel from
the CPU it runs on, whatever the vendor, so where it can pack, it does; ``INFLIGHT_CPU_GEMM=torch``
keeps torch's own matmul.

Why pad the rows. oneDNN builds a matmul primitive the first time it meets a row count (M) and
keeps it in an LRU cache (1,024 primitives by default). Measured on this project's bench preset
with one thread: the first call at a new M cost 5.7 ms against 1.2 ms after, once per M for every
weight of that shape. A served mix of random prompt lengths meets a new token count on nearly every
prefill or mixed step, and a planner validation run paid 47-61 ms more on each such step than the
step-cost model's linear terms.

Why padding costs nothing on AMX. AMX multiplies bf16 in tiles of 16 rows, so a GEMM of 17 to 32
rows costs what 32 rows cost (measured, a layer's four linears: M=100 2.36 ms, M=112 1.92 ms;
M=200 4.25 ms, M=208 3.22 ms; M=1 0.73 ms, M=16 0.73 ms). Rounding every row count up to a multiple
of 16 bounds the shapes to a few dozen, which are all built at start-up (``warm_up``). Without AMX
(AVX512_BF16 or AVX-512 only, and float32 anywhere) the cost grows with every row: on a 2-core EPYC
with AVX512_BF16, SmolLM2-135M's linear layers at one thread took 17.4-18.9 ms for 1-4 rows, 23.9 ms
for 8 and 33.9 ms for 16 in float32. There the rounding is finer (8), and row counts up to 16, a
decode step of a few sequences, are not rounded at all (engine/models/row_padding.py).

Rows beyond the real ones are the model's own business: it pads the step's tokens once, never lets
them reach the KV cache or attention, and drops them from the output (engine/models/llama.py).
"""

from __future__ import annotations

import torch

from engine import envs
from engine.models.row_padding import RowPadding
from engine.platform.cpu import cpu_flags

__all__ = ["RowPadding", "can_prepack", "linear", "pack", "row_grain", "warm_up"]


def row_grain(dtype: torch.dtype) -> int:
    """The row multiple a packed GEMM of ``dtype`` costs nothing to round up to on this CPU (AMX's
    bf16 tiles are 16 rows; elsewhere, float32 on an AMX CPU included, the rounding is finer)."""
    return 16 if dtype == torch.bfloat16 and "amx_bf16" in cpu_flags() else 8


# oneDNN refuses to pack bf16 weights on a CPU without one of these instruction sets (an AVX2-only
# host); there the model keeps plain bf16 weights and torch's own (slow) bf16 matmul. Its float32
# kernels want AVX2 at least (below that, torch's matmul is no slower).
_PACK_FLAGS: dict[torch.dtype, tuple[tuple[str, ...], ...]] = {
    torch.bfloat16: (("avx_ne_convert",), ("avx512bw", "avx512vl", "avx512dq")),
    torch.float32: (("avx2", "fma"), ("avx512f",)),
}


def can_prepack(dtype: torch.dtype) -> bool:
    """Weights of ``dtype`` pack into oneDNN's layout: torch was built with oneDNN (x86 CPU wheels),
    the CPU has the instructions its kernels for that dtype need, and ``INFLIGHT_CPU_GEMM`` does not
    ask for torch's own matmul (with ``inflight`` chosen, oneDNN still takes any weight the engine's
    own kernels cannot: engine/models/cpu_gemm.py)."""
    flags = cpu_flags()
    return (
        envs.cpu_gemm() != "torch"
        and dtype in _PACK_FLAGS
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and any(all(f in flags for f in group) for group in _PACK_FLAGS[dtype])
    )


def pack(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout, chosen for GEMMs of about ``rows`` rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def warm_up(weights: list[tuple[torch.Tensor, int]], padding: RowPadding) -> int:
    """Build the primitive of every (weight shape, padded row count) now, not in the middle of
    serving; returns how many. ``weights``: (packed weight, most rows it multiplies; the LM head
    takes one row per sampled sequence, not per token). One call per pair: the primitive depends on
    the shapes, not on the weight's values."""
    shapes = {(tuple(w.shape), w.dtype, most): w for w, most in weights}
    count = 0
    with torch.inference_mode():
        for rows in padding.sizes():
            for (_, _, most), w in shapes.items():
                if rows <= padding.padded(most):
                    linear(torch.zeros(rows, w.shape[1], dtype=w.dtype), w)
                    count += 1
    return count
