"""The GGUF block formats a linear weight stays in: each one's bytes, and its torch dequantizer.

The format is the contract: the CPU kernels (engine/kernels/cpu/quant_gemm.cpp), the Triton kernel
(engine/kernels/quant_matmul.py) and the dequantizers below read the same bytes, laid out as llama.cpp's
``ggml-common.h`` declares them. A weight row of ``in_features`` values is ``in_features / block_size``
blocks one after another; fp16 fields are little-endian IEEE half. ``QK_K = 256`` is a K-quant's
super-block.

Q8_0 (32 values, 34 bytes)::

    struct block_q8_0 { half d; int8_t qs[32]; };           // x[i] = d * qs[i]

Q4_0 (32 values, 18 bytes): value i < 16 is the low nibble of ``qs[i]``, value 16 + i its high nibble::

    struct block_q4_0 { half d; uint8_t qs[16]; };          // x = d * (q - 8)

Q4_1 (32 values, 20 bytes), nibbles as Q4_0::

    struct block_q4_1 { half d; half m; uint8_t qs[16]; };  // x = d * q + m

Q5_0 (32 values, 22 bytes): Q4_0's nibbles plus a fifth bit per value, bit i of ``qh`` read as one
little-endian 32-bit word (byte i / 8, bit i % 8) for value i::

    struct block_q5_0 { half d; uint8_t qh[4]; uint8_t qs[16]; };          // x = d * (q - 16)

Q5_1 (32 values, 24 bytes), bits as Q5_0::

    struct block_q5_1 { half d; half m; uint8_t qh[4]; uint8_t qs[16]; };  // x = d * q + m

  So value 21 of either is ``qs[5] >> 4`` with ``(qh[2] >> 5) & 1`` as its bit 4. The fp16 fields come
  first: the blocks are 2-byte aligned in a row, never 4 (22 bytes), so ``qh`` is read byte by byte.

Q4_K (256 values, 144 bytes): eight sub-blocks of 32, each with a 6-bit scale and a 6-bit min::

    struct block_q4_K { half d; half dmin; uint8_t scales[12]; uint8_t qs[128]; };
    // x = d * sc[s] * q - dmin * m[s], s = the value's sub-block (index / 32)

  ``qs`` holds four chunks of 64 values in 32 bytes each: chunk j's byte l carries value 64j + l in its
  low nibble and 64j + 32 + l in its high one. The 12 scale bytes hold sc[0..7] and m[0..7]
  (``get_scale_min_k4``)::

      s < 4:  sc = scales[s] & 63
              m  = scales[s + 4] & 63
      s >= 4: sc = (scales[s + 4] & 15) | (scales[s - 4] >> 6) << 4
              m  = (scales[s + 4] >> 4) | (scales[s] >> 6) << 4

Q5_K (256 values, 176 bytes): Q4_K plus a fifth bit per value::

    struct block_q5_K { half d; half dmin; uint8_t scales[12]; uint8_t qh[32]; uint8_t qs[128]; };
    // q = nibble as Q4_K | ((qh[l] >> b) & 1) << 4, b = the value's sub-block (2j or 2j + 1), l = index % 32

Q6_K (256 values, 210 bytes): sixteen sub-blocks of 16 with a signed 8-bit scale each::

    struct block_q6_K { uint8_t ql[128]; uint8_t qh[64]; int8_t scales[16]; half d; };
    // x = d * scales[s] * (q - 32), q = 4 low bits from ql | 2 high bits from qh

  Each half h (128 values) uses ``ql[64h .. 64h + 64]`` and ``qh[32h .. 32h + 32]``. Worked example for
  value i = 128h + 32p + l (p = 0..3, l = 0..31): its low bits are ``ql[64h + 32 (p & 1) + l]``, shifted
  right by ``4 (p >> 1)``; its high bits ``qh[32h + l] >> 2p``; its scale ``scales[8h + 2p + l / 16]``.
  So i = 200 (h 1, p 2, l 8) reads ql[72] >> 4, qh[40] >> 4 and scales[12].
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

QK_K = 256


@dataclass(frozen=True)
class Format:
    """One block format: ``block_size`` values in ``block_bytes`` bytes."""

    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's value
    block_size: int
    block_bytes: int

    def row_bytes(self, in_features: int) -> int:
        if in_features <= 0 or in_features % self.block_size:
            raise ValueError(f"{self.name} needs in features in whole blocks of {self.block_size}")
        return in_features // self.block_size * self.block_bytes


FORMATS: dict[str, Format] = {
    f.name: f
    for f in (
        Format("Q8_0", 8, 32, 34),
        Format("Q4_0", 2, 32, 18),
        Format("Q4_1", 3, 32, 20),
        Format("Q5_0", 6, 32, 22),
        Format("Q5_1", 7, 32, 24),
        Format("Q4_K", 12, QK_K, 144),
        Format("Q5_K", 13, QK_K, 176),
        Format("Q6_K", 14, QK_K, 210),
    )
}


def get_format(name: str) -> Format:
    if name not in FORMATS:
        raise ValueError(f"unsupported block format {name!r}; quantized weights are {', '.join(FORMATS)}")
    return FORMATS[name]


# Dequantizers: blocks [n, block_bytes] uint8 -> values [n, block_size] float32. The float32 operations
# are gguf's own (numpy), in its order, so both give the same bits.


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:  # [n, 1] float32
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, c, 32] bytes -> [n, c, 64] values: each chunk's low nibbles, then its high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * blocks[:, 2:].view(torch.int8).float()


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, None, 2:18]).flatten(1)
    return _half(blocks, 0) * (q.to(torch.int8) - 8).float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, None, 4:20]).flatten(1)
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] qh bytes -> [n, 32] uint8: value i's bit 4 (0 or 16), bit i of qh as a little-endian word."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    return (((qh[:, :, None] >> shifts) & 1) << 4).flatten(1)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, None, 6:22]).flatten(1) | _fifth_bits(blocks[:, 2:6])
    return _half(blocks, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, None, 8:24]).flatten(1) | _fifth_bits(blocks[:, 4:8])
    return _half(blocks, 0) * q.float() + _half(blocks, 2)


def scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 scale bytes of Q4_K/Q5_K blocks [n, 12] -> (sc, m), each [n, 8] int32."""
    s = scales.to(torch.int32)
    low, high, mixed = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([low & 63, (mixed & 15) | ((low >> 6) << 4)], dim=1)
    m = torch.cat([high & 63, (mixed >> 4) | ((high >> 6) << 4)], dim=1)
    return sc, m


def _k_quant(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """x = d * sc * q - dmin * m for Q4_K/Q5_K; q [n, 8, 32] float32 in sub-block order."""
    sc, m = scale_min_k4(blocks[:, 4:16])
    d = (_half(blocks, 0) * sc.float())[:, :, None]
    dm = (_half(blocks, 2) * m.float())[:, :, None]
    return (d * q - dm).flatten(1)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 16:144].view(-1, 4, 32)).view(-1, 8, 32)
    return _k_quant(blocks, q.float())


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 48:176].view(-1, 4, 32)).view(-1, 8, 32)
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device)[None, :, None]
    high = (blocks[:, None, 16:48] >> shifts) & 1  # [n, 8, 32]: sub-block b's bit b
    return _k_quant(blocks, (low | (high << 4)).float())


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    ql = blocks[:, 0:128].view(n, 2, 2, 32)  # [n, half, 32-byte group, l]
    qh = blocks[:, 128:192].view(n, 2, 1, 32)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2)  # [n, half, p, l]: p = 0, 1 low nibbles; 2, 3 high
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=blocks.device)[None, None, :, None]
    high = (qh >> shifts) & 3
    q = ((low | (high << 4)).to(torch.int8) - 32).float().view(n, 16, 16)
    scales = blocks[:, 192:208].view(torch.int8).float()
    d = (_half(blocks, 208) * scales)[:, :, None]
    return (d * q).view(n, QK_K)


_DEQUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def dequantize_rows(fmt: Format, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """Rows of blocks [out, row_bytes] uint8 -> [out, in_features] float32, on the rows' device."""
    assert rows.dtype == torch.uint8 and rows.dim() == 2, (rows.dtype, tuple(rows.shape))
    assert rows.shape[1] == fmt.row_bytes(in_features), (tuple(rows.shape), fmt.name, in_features)
    blocks = rows.contiguous().view(-1, fmt.block_bytes)
    return _DEQUANTIZERS[fmt.name](blocks).view(rows.shape[0], in_features)
