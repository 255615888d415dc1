"""The exponential race: a row's random draw as a function of (seed, output position) only.

Each row's draw uses exponential noise q ~ Exp(1) over the vocabulary and picks argmax(p / q), which is
an exact sample from p (token i wins with probability p_i). q comes from a counter-based hash of
(seed, step, token id) rather than a stateful generator, so:
  * a row draws the same token whatever else shares the batch (no shared generator state);
  * a stream resumed elsewhere from its emitted tokens continues identically (step = number of
    output tokens so far), on another GPU model or on the CPU: the hash is exact integer arithmetic,
    unlike torch's CUDA generators whose streams depend on the launch configuration.

``exponential_noise`` is the definition in torch ops; ``race`` picks the winners, through the C++
kernel on a CPU (engine/kernels/cpu/sampling.cpp) and the definition elsewhere. The GPU's fused
kernel (engine/kernels/sampling.py) computes the same noise from the same ``row_keys``.
"""

from __future__ import annotations

import functools

import torch

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
# Elements per block of noise generation; see exponential_noise.
_NOISE_BLOCK_CPU = 1 << 16
_NOISE_BLOCK_GPU = 1 << 24  # 128 MiB per int64 temporary


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for x in [0, 2**32) held in int64, without int64 overflow.

    c is split in 16-bit halves: x * c_lo < 2**48 and x * c_hi < 2**48, both exact in int64.
    In-place steps on fresh tensors: on CPU the allocations would cost as much as the arithmetic.
    """
    hi = x * (c >> 16)
    hi.bitwise_and_(0xFFFF).bitwise_left_shift_(16)
    return (x * (c & 0xFFFF)).add_(hi).bitwise_and_(_MASK32)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    # MurmurHash3's finaliser: a bijection on 32-bit values with full avalanche. Consumes h.
    h.bitwise_xor_(h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h.bitwise_xor_(h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h.bitwise_xor_(h >> 16)


def row_keys(seeds: list[int], steps: list[int]) -> list[tuple[int, int]]:
    """Two 32-bit keys per (seed, step), mixed so nearby seeds and steps give unrelated noise."""
    keys = []
    for seed, step in zip(seeds, steps, strict=True):
        z = _splitmix64((seed & _MASK64) ^ _splitmix64(step))
        keys.append((z & _MASK32, z >> 32))
    return keys


def exponential_noise(
    seeds: list[int], steps: list[int], vocab_size: int, device: torch.device
) -> torch.Tensor:
    """q ~ Exp(1), shape [len(seeds), vocab_size] float32; row i depends only on (seeds[i], steps[i])."""
    keys = torch.tensor(row_keys(seeds, steps), dtype=torch.int64, device=device)  # [n, 2]
    token = torch.arange(vocab_size, dtype=torch.int64, device=device)[None, :]  # [1, V]
    mixed = _mul32(token, 0x9E3779B1)  # spread consecutive ids before keying
    q = torch.empty(len(seeds), vocab_size, dtype=torch.float32, device=device)
    # Work in blocks of rows. On CPU small blocks stay in cache (2-3x faster); on a GPU big blocks
    # keep launches few while bounding the 8-byte temporaries next to a full KV cache.
    block = _NOISE_BLOCK_CPU if device.type == "cpu" else _NOISE_BLOCK_GPU
    rows_per_block = max(1, block // vocab_size)
    for start in range(0, len(seeds), rows_per_block):
        k1, k2 = keys[start : start + rows_per_block].unbind(dim=1)
        # Two keyed rounds of a bijection: distinct token ids never share a hash within a row.
        h = _fmix32(_fmix32(mixed ^ k1[:, None]).bitwise_xor_(k2[:, None]))  # [rows, V] in [0, 2**32)
        # Uniform in (0, 1), never 0 or 1, then q = -log(u); float64 keeps the tail of q exact.
        u = h.to(torch.float64).add_(0.5).mul_(1.0 / 4294967296.0)
        q[start : start + rows_per_block] = u.log_().neg_()
    return q


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for [n, V] float32, through the C++ CPU kernel where it is built: torch's CPU
    argmax reads about 0.35 GB/s, 9 ms a step for 64 rows of a 49k vocabulary. Same result (first
    index of the maximum, NaN counting as the maximum)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
        from engine.kernels import cpu as cpu_kernels

        if cpu_kernels.load():
            return torch.ops.inflight_cpu.argmax_rows(x)
    return x.argmax(dim=-1)


@functools.cache
def _cpu_race_runs() -> bool:
    """The C++ race is built and runs here (asked once, not on every step)."""
    from engine.kernels import cpu as cpu_kernels

    return cpu_kernels.load() and bool(torch.ops.inflight_cpu.exponential_race_supported())


def _cpu_race(logits: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    tokens: torch.Tensor = torch.ops.inflight_cpu.exponential_race(logits, keys)
    return tokens


def race(logits: torch.Tensor, seeds: list[int], steps: list[int]) -> torch.Tensor:
    """argmax(logits - log q) per row, q = ``exponential_noise(seeds, steps, ...)``: the exponential race's
    winners. On a CPU with the C++ kernels (and a torch with MKL), a row at a time in cache-sized chunks
    (engine/kernels/cpu/sampling.cpp: the same scores bit for bit, without the noise's whole-vocabulary
    int64 and float64 temporaries, which cost about 1 ms a row of a 49k vocabulary); elsewhere the
    noise, then its log, then ``argmax_rows``."""
    cpu = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
    if cpu and logits.stride(1) == 1 and logits.shape[1] > 0 and _cpu_race_runs():
        return _cpu_race(logits, torch.tensor(row_keys(seeds, steps), dtype=torch.int64))
    q = exponential_noise(seeds, steps, logits.shape[1], logits.device)
    # argmax(p / q) == argmax(logits - log q): softmax's normaliser is the same for every token,
    # and the log form keeps precision for tokens whose probability underflows.
    return argmax_rows(logits - q.log())
