"""A fused weight whose row ranges are stored in different formats, each multiplied as stored.

GGUF mixes pick a format per tensor: llama.cpp's Q4_K_M keeps v in Q6_K (or Q8_0 where rows are not
whole 256s) beside Q4_K or Q5_0 q and k. The engine fuses q/k/v (and gate/up) into one linear to run one
product instead of three; rows of one format concatenate (``QuantizedWeight.cat_rows``), rows of several
do not. Dequantizing such a weight to float32 would read four to eight times its bytes at every decode
step, so the parts stay as they are: each is multiplied on its own kernel and the outputs are laid side
by side, which is the fused product's output exactly (rows of a linear's weight are independent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from engine.quant.channel import ChannelWeight
from engine.quant.weight import QuantizedWeight

Part = torch.Tensor | QuantizedWeight | ChannelWeight


@dataclass(frozen=True)
class StackedWeight:
    """``parts``' rows one after another: [sum(splits), in_features]. ``splits`` and ``in_features`` are
    kept apart from the parts because a float part may be packed for its kernel (column panels, oneDNN's
    layout), whose shape no longer says its rows."""

    parts: tuple[Part, ...]
    splits: tuple[int, ...]  # each part's out features, in order
    in_features: int

    def __post_init__(self) -> None:
        if len(self.parts) < 2 or len(self.parts) != len(self.splits):
            raise ValueError("a stacked weight has at least two parts, each with its out features")

    @staticmethod
    def of(parts: Sequence[Part]) -> StackedWeight:
        """Unpacked parts of one in_features (what a checkpoint holds)."""
        shapes = [_shape(p) for p in parts]
        if len({cols for _, cols in shapes}) != 1:
            raise ValueError(f"parts of a stacked weight must share in_features, got {shapes}")
        return StackedWeight(tuple(parts), tuple(rows for rows, _ in shapes), shapes[0][1])

    @property
    def out_features(self) -> int:
        return sum(self.splits)

    @property
    def nbytes(self) -> int:
        return sum(
            p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.nbytes for p in self.parts
        )

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def map(self, fn: Callable[[Part], Part]) -> StackedWeight:
        """The same rows with ``fn`` applied to every part (placing on a device, packing for a kernel)."""
        return StackedWeight(tuple(fn(p) for p in self.parts), self.splits, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """[out_features, in_features] float32 of unpacked parts: the reference the fused product meets."""
        return torch.cat([p.float() if isinstance(p, torch.Tensor) else p.dequantize() for p in self.parts])


def _shape(p: Part) -> tuple[int, int]:
    if isinstance(p, torch.Tensor):
        if p.dim() != 2:
            raise ValueError(f"a float part must be [out, in], got {list(p.shape)}")
        return int(p.shape[0]), int(p.shape[1])
    return p.out_features, p.in_features


def any_kept_quantized(weights: Iterable[object]) -> bool:
    """Whether any of ``weights`` is kept quantized (GGUF blocks, int8, or such parts stacked). The
    engine then pads no rows to oneDNN's tiles (engine/models/row_padding.py): the quantized kernels'
    time grows with every row, so a decode step of one sequence padded to 16 rows cost about 4x its
    unpadded time (SmolLM2's Q4_1, bf16, one thread, a 2-core Xeon with AMX: 10 tokens a second
    against 39), which the few float layers left to oneDNN do not win back."""
    return any(isinstance(w, QuantizedWeight | ChannelWeight | StackedWeight) for w in weights)
