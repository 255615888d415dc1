"""A linear layer's weight kept in a GGUF block format."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.quant.formats import FORMATS, Format, dequantize_rows, get_format


@dataclass(frozen=True)
class QuantizedWeight:
    """``out_features`` rows of ``in_features`` values, each row its blocks' bytes exactly as GGUF stores
    them (no repacking: the kernels read a row's blocks front to back, which is already the stream they
    want, and the same bytes then serve the CPU, the GPU and a checkpoint).

    ``blocks``: uint8 [out_features, row_bytes], contiguous rows; row_bytes = in_features / block_size *
    block_bytes. Rows are independent, so a tensor-parallel shard of out features is a row range
    (``narrow_rows``) and a fused QKV or gate-up weight a concatenation (``cat_rows``).
    """

    format: str
    out_features: int
    in_features: int
    blocks: torch.Tensor

    def __post_init__(self) -> None:
        fmt = get_format(self.format)
        expected = (self.out_features, fmt.row_bytes(self.in_features))
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != expected:
            raise ValueError(
                f"{self.format} blocks of a [{self.out_features}, {self.in_features}] weight must be uint8 "
                f"{list(expected)}, got {self.blocks.dtype} {list(self.blocks.shape)}"
            )
        if self.blocks.stride(1) != 1 or (self.out_features > 1 and self.blocks.stride(0) != expected[1]):
            raise ValueError("blocks must be contiguous rows")

    @property
    def fmt(self) -> Format:
        return FORMATS[self.format]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def narrow_rows(self, start: int, stop: int) -> QuantizedWeight:
        """Out features [start, stop): a view of those rows' blocks."""
        if not 0 <= start < stop <= self.out_features:
            raise ValueError(f"rows [{start}, {stop}) outside [0, {self.out_features})")
        return QuantizedWeight(self.format, stop - start, self.in_features, self.blocks[start:stop])

    @staticmethod
    def cat_rows(weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """Whole rows one after another (fused QKV: q's rows, then k's, then v's)."""
        if not weights:
            raise ValueError("nothing to concatenate")
        first = weights[0]
        for w in weights[1:]:
            if (w.format, w.in_features) != (first.format, first.in_features):
                raise ValueError(
                    f"cannot concatenate {w.format} [{w.in_features}] rows with "
                    f"{first.format} [{first.in_features}] rows"
                )
        blocks = torch.cat([w.blocks for w in weights], dim=0)
        return QuantizedWeight(first.format, blocks.shape[0], first.in_features, blocks)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.format, self.out_features, self.in_features, self.blocks.to(device))

    def dequantize(self) -> torch.Tensor:
        """[out_features, in_features] float32 on the blocks' device: the reference every kernel meets."""
        return dequantize_rows(self.fmt, self.blocks, self.in_features)


def random_quantized(
    format: str, out_features: int, in_features: int, generator: torch.Generator, scale: float = 0.01
) -> QuantizedWeight:
    """Valid random blocks: random quants, fp16 scales (and mins) around ``scale``. What a kernel test
    or benchmark needs where gguf cannot quantize a float weight into ``format``."""
    fmt = get_format(format)
    num_blocks = out_features * in_features // fmt.block_size
    blocks = torch.randint(0, 256, (num_blocks, fmt.block_bytes), generator=generator, dtype=torch.uint8)

    def halves(offset: int, low: float, high: float) -> None:
        values = torch.empty(num_blocks, 1).uniform_(low, high, generator=generator).half()
        blocks[:, offset : offset + 2] = values.view(torch.uint8)

    if fmt.name in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        halves(0, -scale, scale)
        # A min near minus half the quants' span (q up to 15 or 31) centres the values on zero, as a
        # quantizer's min of a zero-mean row would.
        if fmt.name == "Q4_1":
            halves(2, -8 * scale, 0.0)
        elif fmt.name == "Q5_1":
            halves(2, -16 * scale, 0.0)
    elif fmt.name in ("Q4_K", "Q5_K"):
        # A sub-block's scale is d * sc with sc up to 63: d near scale / 32 keeps values near scale * q.
        halves(0, 0.0, scale / 32)
        halves(2, 0.0, scale / 4)
    else:  # Q6_K: int8 sub-block scales
        halves(208, 0.0, scale / 64)
    return QuantizedWeight(fmt.name, out_features, in_features, blocks.view(out_features, -1))
