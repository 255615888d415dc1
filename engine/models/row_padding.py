"""Row counts rounded up to whole GEMM tiles (why: engine/models/onednn.py). Pure Python: the model
pads with it, and the step-cost model (engine/cost_model.py) charges a step for the rows it pads to."""

from __future__ import annotations

# Past this many rows the grain coarsens, so that a large token budget still fits oneDNN's cache of
# 1,024 primitives (five weight shapes a row count: qkv, o, gate_up, down, lm_head).
FINE_ROWS = 1024
COARSE_GRAIN = 64
# Up to this many rows a grain finer than it pads nothing: there (decode steps of a few sequences) a
# GEMM mostly streams the weights, and each extra row still adds to its time. Measured with one thread
# on a 2-core AVX-512 EPYC, SmolLM2-135M's linear layers on packed float32 weights: 17.4-18.9 ms at 1-4
# rows, 23.9 at 8, 30.4 at 15, 33.9 at 16 (bf16: 10.4-10.9, 12.6, 16.1, 16.3). A grain of EXACT_ROWS or
# more (AMX's tiles of 16 rows, where 1 to 16 rows cost the same) keeps its rounding from row 1.
EXACT_ROWS = 16


class RowPadding:
    """Row counts rounded up to ``grain`` (``COARSE_GRAIN`` past ``FINE_ROWS``), up to ``limit``:
    a count above it (a prompt longer than the token budget) runs as it is, and so does one of at
    most ``EXACT_ROWS`` when ``grain`` is finer than that."""

    def __init__(self, grain: int, limit: int) -> None:
        self.grain = grain
        self.limit = limit

    def padded(self, n: int) -> int:
        if self.grain <= 1 or n > self.limit or (n <= EXACT_ROWS and self.grain < EXACT_ROWS):
            return n
        grain = self.grain if n <= FINE_ROWS else COARSE_GRAIN
        return min(-(-n // grain) * grain, self.limit)

    def sizes(self) -> list[int]:
        """Every row count ``padded`` can return for 1..limit."""
        return sorted({self.padded(n) for n in range(1, self.limit + 1)})

    def built(self) -> list[int]:
        """The row counts whose kernels an engine padding this way builds when it loads (none when
        it pads nothing)."""
        return self.sizes() if self.grain > 1 else []
