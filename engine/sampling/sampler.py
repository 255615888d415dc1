"""One step of token selection for a batch of rows, on the logits' device.

Order, as in vLLM: logit_bias -> penalties (repetition over prompt + output, presence / frequency over
output) -> min_tokens masking -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> random draw.

The random draw is the exponential race of engine/sampling/race.py: a function of (seed, output
position) only, whatever else shares the batch.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sampling.logit_bias import apply_logit_bias
from engine.sampling.race import argmax_rows, exponential_noise, race, row_keys
from engine.sampling.sampled import SampledTensors, SamplerOutput, index_on
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured.grammar import GrammarState

__all__ = [
    "Sampler",
    "SamplingRow",
    "apply_min_p",
    "apply_penalties",
    "apply_top_k",
    "apply_top_p",
    # The race's (engine/sampling/race.py), for the callers that import them from here.
    "argmax_rows",
    "exponential_noise",
    "race",
    "row_keys",
]


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
        # Dividing by 1 changes no value, so a batch all at temperature 1 (what a request that sends no
        # temperature gets) skips a pass over the logits; the steps below then must not write into the
        # caller's tensor.
        owned = any(p.temperature != 1.0 for p in params)
        if owned:
            temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
            logits = logits / temps[:, None]
        # Fast path: no top-k / top-p work unless some row asks; the sort covers only top-p rows.
        if any(0 < p.effective_top_k < vocab for p in params):
            top_k = [p.effective_top_k if p.effective_top_k < vocab else 0 for p in params]
            masked = apply_top_k(logits, torch.tensor(top_k, device=device))
            owned = owned or masked is not logits
            logits = masked
        p_rows = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if p_rows:
            top_p = torch.tensor([params[j].top_p for j in p_rows], dtype=logits.dtype, device=device)
            if len(p_rows) == len(params):
                logits = apply_top_p(logits, top_p)
            else:
                logits = logits if owned else logits.clone()
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
