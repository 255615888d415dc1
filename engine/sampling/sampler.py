"""One step of token selection for a batch of rows, on the logits' device.

Order, as in vLLM: logit_bias -> penalties (repetition over prompt + output, presence / frequency over
output) -> min_tokens masking -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> random draw.

Randomness is a function of (seed, output position) only. Each row's draw uses exponential noise
q ~ Exp(1) over the vocabulary and picks argmax(p / q), which is an exact sample from p (the
"exponential race": token i wins with probability p_i). q comes from a counter-based hash of
(seed, step, token id) rather than a stateful generator, so:
  * a row draws the same token whatever else shares the batch (no shared generator state);
  * a stream resumed elsewhere from its emitted tokens continues identically (step = number of
    output tokens so far), on another GPU model or on the CPU: the hash is exact integer arithmetic,
    unlike torch's CUDA generators whose streams depend on the launch configuration.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sampling.logit_bias import apply_logit_bias
from engine.sampling.sampled import SampledTensors, SamplerOutput, index_on
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.grammar import GrammarState

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
# Elements per block of noise generation; see exponential_noise.
_NOISE_BLOCK_CPU = 1 << 16
_NOISE_BLOCK_GPU = 1 << 24  # 128 MiB per int64 temporary


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sequence in the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # includes a resumed stream's earlier tokens
    seed: int  # the request's seed, or one the engine drew when it arrived
    eos_token_id: int | None = None
    # len(output_token_ids) unless given: async scheduling passes the count alone (and an empty list)
    # for rows without penalties, the only ones that read the tokens themselves.
    num_output_tokens: int = -1
    # The sequence's grammar matcher (structured outputs): masks the logits, then takes the drawn token.
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        if self.num_output_tokens < 0:
            self.num_output_tokens = len(self.output_token_ids)

    @property
    def has_penalties(self) -> bool:
        p = self.params
        return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


# ---- counter-based noise ---------------------------------------------------------------------
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


# ---- logit processing --------------------------------------------------------------------------
def _row_token_pairs(lists: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row index, token id) pairs for index_put_: one host-to-device copy each."""
    rows = [i for i, ids in enumerate(lists) for _ in ids]
    flat = [t for ids in lists for t in ids]
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(flat, dtype=torch.long, device=device),
    )


def _unique_pairs(
    lists: list[list[int]], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each distinct (row, token) of ``lists`` once, as flat indices row * vocab + token, with how many
    times it occurs."""
    rows, tokens = _row_token_pairs(lists, device)
    flat, counts = torch.unique(rows * vocab + tokens, return_counts=True)
    return flat, counts


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Penalised copy of ``logits`` [N, V]; ``logits`` itself (unchanged) when no row has penalties.

    repetition (HF / CTRL): for every token seen in prompt or output, logit / p if positive else * p.
    presence / frequency (OpenAI): logit -= presence * (count > 0) + frequency * count, output only.

    Only the tokens a row has seen change, so only those are touched: the distinct (row, token) pairs
    are gathered, penalised and written back, where whole [N, V] tensors of counts and masks cost
    tens of milliseconds a step on a CPU (20 ms at 32 rows of 49k, 66 ms at 152k).
    """
    vocab = logits.shape[1]
    device = logits.device
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    freq = [
        i for i, r in enumerate(rows) if r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0
    ]
    if not rep and not freq:
        return logits
    out = logits.clone()
    flat_out = out.view(-1)
    if rep:
        seen, _ = _unique_pairs(
            [
                rows[i].prompt_token_ids + rows[i].output_token_ids if i in rep else []
                for i in range(len(rows))
            ],
            vocab,
            device,
        )
        p = torch.tensor([r.params.repetition_penalty for r in rows], dtype=logits.dtype, device=device)
        p = p[torch.div(seen, vocab, rounding_mode="floor")]
        x = flat_out[seen]
        flat_out[seen] = torch.where(x > 0, x / p, x * p)
    if freq:
        outputs = [r.output_token_ids if i in freq else [] for i, r in enumerate(rows)]
        found, counts = _unique_pairs(outputs, vocab, device)
        row_of = torch.div(found, vocab, rounding_mode="floor")
        pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=logits.dtype, device=device)
        fr = torch.tensor([r.params.frequency_penalty for r in rows], dtype=logits.dtype, device=device)
        # The dense form's arithmetic, element for element: x - fr * count - pres * 1.
        flat_out[found] = flat_out[found] - fr[row_of] * counts.to(logits.dtype) - pres[row_of]
    return out


def _min_tokens_mask(rows: list[SamplingRow], vocab: int) -> list[tuple[int, int]]:
    """(row, token) pairs banned because the row has not reached min_tokens yet.

    Banned: stop_token_ids, and eos unless ignore_eos (then eos does not stop the row anyway). Not for a
    row with a grammar: once its grammar is complete eos may be the only token it allows.
    """
    pairs: list[tuple[int, int]] = []
    for i, r in enumerate(rows):
        if r.num_output_tokens < r.params.min_tokens and r.grammar is None:
            banned = set(r.params.stop_token_ids)
            if r.eos_token_id is not None and not r.params.ignore_eos:
                banned.add(r.eos_token_id)
            pairs.extend((i, t) for t in sorted(banned) if 0 <= t < vocab)
    return pairs


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) logits below each row's k-th largest; top_k [n] int64, 0 for "off".

    torch.topk up to the largest k instead of a full sort (a sort of the vocabulary is ~30x slower
    on CPU). Tokens tied with the k-th logit all stay.
    """
    k_max = int(top_k.max())
    if k_max <= 0:
        return logits
    top_vals = logits.topk(k_max, dim=-1).values  # [n, k_max], descending
    kth = top_vals.gather(1, (top_k.clamp(min=1) - 1)[:, None])  # [n, 1]
    kth = kth.masked_fill(top_k[:, None] <= 0, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's nucleus: the fewest most likely tokens whose probability mass reaches top_p.

    top_p: [n] float in (0, 1). The most likely token always stays. Example, probs (0.4, 0.3, 0.2, 0.1)
    and top_p 0.5: the mass before each token is (0, 0.4, 0.7, 0.9), so tokens 0 and 1 stay.

    On a CPU with the C++ kernels, without a sort of the vocabulary (engine/kernels/cpu/sampling.cpp:
    a threshold on the logit, about 10x faster at 32 rows of 49k); a tie at the threshold then stays
    whole, where the sort keeps an order-dependent part of it.
    """
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        from engine.kernels import cpu as cpu_kernels

        if cpu_kernels.load():
            out = logits.contiguous().clone()
            torch.ops.inflight_cpu.top_p_mask_(out, top_p.to(torch.float32))
            return out
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [n, V]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p [n] times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for [n, V] float32, through the C++ CPU kernel where it is built: torch's CPU
    argmax reads about 0.35 GB/s, 9 ms a step for 64 rows of a 49k vocabulary. Same result (first
    index of the maximum, NaN counting as the maximum)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
        from engine.kernels import cpu as cpu_kernels

        if cpu_kernels.load():
            return torch.ops.inflight_cpu.argmax_rows(x)
    return x.argmax(dim=-1)


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
    if cpu and logits.stride(1) == 1 and logits.shape[1] > 0:
        from engine.kernels import cpu as cpu_kernels

        if cpu_kernels.load() and torch.ops.inflight_cpu.exponential_race_supported():
            return _cpu_race(logits, torch.tensor(row_keys(seeds, steps), dtype=torch.int64))
    q = exponential_noise(seeds, steps, logits.shape[1], logits.device)
    # argmax(p / q) == argmax(logits - log q): softmax's normaliser is the same for every token,
    # and the log form keeps precision for tokens whose probability underflows.
    return argmax_rows(logits - q.log())


def _draw_fused(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The torch path's draw in one Triton launch; per-row settings travel in one host-to-device copy."""
    from engine.kernels.sampling import sample

    vocab = logits.shape[1]
    params = [r.params for r in rows]
    top_k = [p.effective_top_k if p.effective_top_k < vocab else 0 for p in params]
    keys = row_keys([r.seed for r in rows], [r.num_output_tokens for r in rows])
    # One float64 table carries every setting (exact for the keys, which are < 2**32).
    table = torch.tensor(
        [
            [p.temperature, k, p.top_p, p.min_p, k1, k2]
            for p, k, (k1, k2) in zip(params, top_k, keys, strict=True)
        ],
        dtype=torch.float64,
    )
    table = table.pin_memory().to(logits.device, non_blocking=True) if logits.is_cuda else table
    return sample(
        logits.contiguous(),
        table[:, 0].float(),
        table[:, 1].int(),
        table[:, 2].float(),
        table[:, 3].float(),
        table[:, 4:].long().contiguous(),
        use_top_k=any(top_k),
        use_top_p=any(p.top_p < 1.0 for p in params),
        use_min_p=any(p.min_p > 0.0 for p in params),
    )


# ---- the sampler ----------------------------------------------------------------------------------
class Sampler:
    """Chooses one token per row; see the module docstring for the order of operations.

    fused: draw the random rows with the Triton kernel (engine/kernels/sampling.py: same noise, no
    sort, no host sync); None = on CUDA when triton is installed. The CPU stays on torch ops.
    """

    def __init__(self, fused: bool | None = None) -> None:
        self.fused = fused
        # Host seconds spent on grammar masks (fill, apply, advance) since start, the fill counted even
        # where it overlapped the forward pass: the cost of structured outputs, reported by benchmarks.
        # Stays 0 while no row is constrained.
        self.grammar_seconds = 0.0
        self._mask_pool: ThreadPoolExecutor | None = None  # started by the first constrained step

    def _use_fused(self, device: torch.device) -> bool:
        if self.fused is not None:
            return self.fused
        if device.type != "cuda":
            return False
        from engine.kernels import triton_available

        return triton_available()

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: Future[torch.Tensor] | None = None
    ) -> SamplerOutput:
        return self.sample(logits, rows, masks).to_host()

    def begin_masks(self, rows: list[SamplingRow], vocab_size: int) -> Future[torch.Tensor] | None:
        """Start filling the step's grammar bitmasks on a helper thread, before the forward pass, so the
        fill overlaps the model (torch releases the GIL in its kernels); ``sample`` waits for it. None
        (no thread, no work) when no row has a grammar. The rows' grammars must not advance meanwhile:
        they do only in ``sample``, after the wait."""
        if all(r.grammar is None for r in rows):
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="inflight-grammar")
        return self._mask_pool.submit(self._fill, rows, vocab_size)

    def sample(
        self, logits: torch.Tensor, rows: list[SamplingRow], masks: Future[torch.Tensor] | None = None
    ) -> SampledTensors:
        """The tokens (and logprobs) on the logits' device, without waiting for them. ``masks``: the
        bitmasks ``begin_masks`` started for these rows (else they are filled here)."""
        n, vocab = logits.shape
        if n != len(rows):
            raise ValueError(f"logits has {n} rows but {len(rows)} sampling rows were given")
        logits = logits.float()
        device = logits.device
        if n == 0:
            return SampledTensors(torch.empty(0, dtype=torch.int64, device=device), [], [])
        work = apply_penalties(apply_logit_bias(logits, rows), rows)
        banned = _min_tokens_mask(rows, vocab)
        if banned:
            if work is logits:
                work = logits.clone()  # the caller's logits stay untouched
            b_rows, b_tokens = torch.tensor(banned, dtype=torch.long, device=device).unbind(dim=1)
            work[b_rows, b_tokens] = float("-inf")
        # Only rows with a grammar pay for one: a batch without any does no mask work at all.
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            if work is logits:
                work = logits.clone()
            self._mask(work, rows, constrained, masks)

        random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
        if len(random_rows) == n:
            tokens = self._draw(work, rows)
        else:
            tokens = argmax_rows(work)  # right for greedy rows; random rows are overwritten below
            if random_rows:
                idx = index_on(random_rows, device)
                tokens[idx] = self._draw(work[idx], [rows[i] for i in random_rows])
        if constrained:
            self._advance(tokens, rows, constrained)
        return self._logprobs(logits, rows, tokens)

    def _fill(self, rows: list[SamplingRow], vocab_size: int) -> torch.Tensor:
        """[n, ceil(V / 32)] int32 bitmasks: each constrained row's allowed tokens, other rows all ones."""
        from engine.structured.grammar import allocate_bitmask

        start = time.perf_counter()
        bitmask = allocate_bitmask(len(rows), vocab_size)
        for i, r in enumerate(rows):
            if r.grammar is not None:
                r.grammar.fill(bitmask, i)
        self.grammar_seconds += time.perf_counter() - start
        return bitmask

    def _mask(
        self,
        work: torch.Tensor,
        rows: list[SamplingRow],
        constrained: list[int],
        masks: Future[torch.Tensor] | None,
    ) -> None:
        """-inf on every token the rows' grammars refuse, applied to all constrained rows in one pass."""
        from engine.structured.grammar import apply_bitmask

        bitmask = masks.result() if masks is not None else None
        if bitmask is None or bitmask.shape[0] != work.shape[0] or bitmask.shape[1] * 32 < work.shape[1]:
            bitmask = self._fill(rows, work.shape[1])
        start = time.perf_counter()
        apply_bitmask(work, bitmask, constrained)
        self.grammar_seconds += time.perf_counter() - start

    def _advance(self, tokens: torch.Tensor, rows: list[SamplingRow], constrained: list[int]) -> None:
        """Each constrained row's grammar takes its drawn token (on a GPU this waits for the draw: a cost
        paid only by steps with constrained rows)."""
        start = time.perf_counter()
        chosen = tokens[index_on(constrained, tokens.device)].tolist()
        for i, token in zip(constrained, chosen, strict=True):
            grammar = rows[i].grammar
            assert grammar is not None
            grammar.accept(token)
        self.grammar_seconds += time.perf_counter() - start

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Sample one token per row of ``logits`` [m, V] (penalised, masked)."""
        vocab = logits.shape[1]
        device = logits.device
        params = [r.params for r in rows]
        if self._use_fused(device):
            return _draw_fused(logits, rows)
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        logits = logits / temps[:, None]
        # Fast path: no top-k / top-p work unless some row asks; the sort covers only top-p rows.
        if any(0 < p.effective_top_k < vocab for p in params):
            top_k = [p.effective_top_k if p.effective_top_k < vocab else 0 for p in params]
            logits = apply_top_k(logits, torch.tensor(top_k, device=device))
        p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:
            top_p = torch.tensor([params[j].top_p for j in p_rows], dtype=logits.dtype, device=device)
            if len(p_rows) == len(params):
                logits = apply_top_p(logits, top_p)
            else:
                logits[p_rows] = apply_top_p(logits[p_rows], top_p)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype, device=device)
            logits = apply_min_p(logits, min_p)
        return race(logits, [r.seed for r in rows], [r.num_output_tokens for r in rows])

    @staticmethod
    def _logprobs(raw: torch.Tensor, rows: list[SamplingRow], tokens: torch.Tensor) -> SampledTensors:
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        nums = [rows[i].params.logprobs or 0 for i in want]
        if not want:
            return SampledTensors(tokens, [], [])
        idx = index_on(want, raw.device)
        logprobs = torch.log_softmax(raw[idx], dim=-1)  # [w, V], before penalties and temperature
        top_vals, top_ids = logprobs.topk(max(nums), dim=-1)  # k == 0 gives [w, 0]
        sampled = logprobs.gather(1, tokens[idx][:, None]).squeeze(1)
        return SampledTensors(tokens, want, nums, top_vals, top_ids, sampled)
