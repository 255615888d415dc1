"""Sampler: vLLM-like semantics, and draws that depend only on (seed, output position)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from engine.sampling.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    exponential_noise,
)
from engine.sampling_params import SamplingParams

V = 64
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def row(
    seed: int = 0,
    out: list[int] | None = None,
    prompt: list[int] | None = None,
    eos: int | None = None,
    **params: object,
) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=prompt if prompt is not None else [1, 2, 3],
        output_token_ids=out if out is not None else [],
        seed=seed,
        eos_token_id=eos,
    )


def logits_for(n: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def frequencies(probs_logits: torch.Tensor, num: int, **params: Any) -> torch.Tensor:
    """Empirical token distribution over ``num`` seeds for one row of logits."""
    rows = [row(seed=s, **params) for s in range(num)]
    out = Sampler()(probs_logits.expand(num, -1).contiguous(), rows)
    return torch.bincount(torch.tensor(out.token_ids), minlength=probs_logits.shape[-1]).float() / num


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_is_argmax(device: str) -> None:
    logits = logits_for(6).to(device)
    out = Sampler()(logits, [row(seed=s, temperature=0.0) for s in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()
    assert out.logprobs == [None] * 6


def test_input_logits_are_not_modified() -> None:
    logits = logits_for(3)
    before = logits.clone()
    rows = [
        row(temperature=0.7, top_k=5, repetition_penalty=1.3, out=[4, 4]),
        row(temperature=0.0, min_tokens=2, eos=int(logits[1].argmax())),
        row(temperature=1.0, top_p=0.5, min_p=0.1, frequency_penalty=1.0, out=[7]),
    ]
    Sampler()(logits, rows)
    assert torch.equal(logits, before)


def test_temperature_one_batch_keeps_the_callers_logits_and_draws() -> None:
    # All rows at temperature 1: no division, so top-p on some rows must not write into the caller's
    # logits; each row draws what it draws alone (and a temperature-1 row in a batch that divides).
    logits = logits_for(3, seed=4)
    before = logits.clone()
    rows = [row(seed=1, top_p=0.6), row(seed=2), row(seed=3, top_p=0.3)]
    got = Sampler()(logits, rows).token_ids
    assert torch.equal(logits, before)
    alone = [Sampler()(logits[i : i + 1].clone(), [r]).token_ids[0] for i, r in enumerate(rows)]
    assert got == alone
    divided = Sampler()(torch.cat([logits, logits[:1]]), [*rows, row(seed=9, temperature=0.5)]).token_ids
    assert divided[:3] == got


def test_seeded_draw_does_not_depend_on_the_batch() -> None:
    rng = random.Random(0)
    sampler = Sampler()
    target_logits = logits_for(1, seed=42)[0]
    target = row(seed=1234, out=[5, 6, 7], temperature=0.9, top_k=20, top_p=0.9)
    alone = sampler(target_logits[None], [target]).token_ids[0]
    for trial in range(10):
        others = [
            row(
                seed=rng.randrange(10**9),
                temperature=rng.choice([0.0, 0.5, 1.5]),
                top_p=rng.choice([1.0, 0.3]),
            )
            for _ in range(rng.randint(1, 6))
        ]
        position = rng.randint(0, len(others))
        rows = [*others[:position], target, *others[position:]]
        logits = logits_for(len(rows), seed=trial)
        logits[position] = target_logits
        assert sampler(logits, rows).token_ids[position] == alone


def test_draw_depends_on_seed_and_step_only() -> None:
    logits = torch.zeros(1, V)  # uniform: any token may win
    sampler = Sampler()

    def draw(seed: int, out: list[int]) -> int:
        return sampler(logits, [row(seed=seed, out=out)]).token_ids[0]

    # Same length of output, different contents: same draw (the position is what counts).
    assert draw(7, [1, 2, 3]) == draw(7, [9, 9, 9]) == draw(7, [0, 5, 60])
    by_step = [draw(7, [0] * i) for i in range(40)]
    by_seed = [draw(s, [0, 0]) for s in range(40)]
    assert len(set(by_step)) > 15 and len(set(by_seed)) > 15


def test_resumed_row_matches_a_fresh_computation() -> None:
    # A row whose output already has i tokens draws argmax(logits / T - log q(seed, i)).
    logits = logits_for(5, seed=3)
    temps = [0.5, 0.8, 1.0, 1.3, 2.0]
    lengths = [0, 1, 7, 30, 500]
    rows = [row(seed=100 + j, out=[3] * lengths[j], temperature=temps[j]) for j in range(5)]
    got = Sampler()(logits, rows).token_ids
    for j in range(5):
        q = exponential_noise([100 + j], [lengths[j]], V, torch.device("cpu"))[0]
        assert got[j] == int((logits[j] / temps[j] - q.log()).argmax())


def test_noise_is_exponential_and_keyed() -> None:
    q = exponential_noise([1, 1, 2], [0, 1, 0], 50_000, torch.device("cpu"))
    assert q.shape == (3, 50_000) and bool((q > 0).all())
    assert abs(q.mean().item() - 1.0) < 0.02 and abs(q.var().item() - 1.0) < 0.05
    again = exponential_noise([2, 1], [0, 0], 50_000, torch.device("cpu"))
    assert torch.equal(again[0], q[2]) and torch.equal(again[1], q[0])
    assert not torch.equal(q[0], q[1]) and not torch.equal(q[0], q[2])
    # Neighbouring seeds / steps / tokens are uncorrelated.
    assert abs(torch.corrcoef(q[:2])[0, 1].item()) < 0.03
    assert abs(torch.corrcoef(torch.stack([q[0, :-1], q[0, 1:]]))[0, 1].item()) < 0.03


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_samples_follow_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    freq = frequencies(logits[None], 20_000, temperature=temperature)
    expected = torch.softmax(logits / temperature, dim=-1)
    assert (freq - expected).abs().max().item() < 0.015


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = logits_for(8, seed=5)
    greedy = logits.argmax(-1).tolist()
    assert Sampler()(logits, [row(seed=s, top_k=1, temperature=1.5) for s in range(8)]).token_ids == greedy
    assert Sampler()(logits, [row(seed=s, top_p=1e-6, temperature=1.5) for s in range(8)]).token_ids == greedy


def test_top_k_samples_only_the_k_best() -> None:
    logits = logits_for(1, seed=9)
    freq = frequencies(logits, 4000, top_k=4, temperature=3.0)
    allowed = set(logits[0].topk(4).indices.tolist())
    assert set(torch.nonzero(freq).flatten().tolist()) == allowed


def test_top_p_nucleus() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # Mass before each token: 0, 0.4, 0.7, 0.9 -> top_p 0.5 keeps tokens 0 and 1, renormalised.
    freq = frequencies(logits, 10_000, top_p=0.5)
    assert freq[2] == 0 and freq[3] == 0
    assert abs(freq[0].item() - 4 / 7) < 0.02
    masked = apply_top_p(logits, torch.tensor([0.75]))
    assert torch.isinf(masked[0, 3]) and bool(torch.isfinite(masked[0, :3]).all())
    assert torch.equal(masked[0, :3], logits[0, :3])


def test_top_k_per_row() -> None:
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [1.0, 3.0, 3.0, 2.0]])
    masked = apply_top_k(logits, torch.tensor([2, 0, 1]))  # 0: off; ties at the k-th value all stay
    assert torch.isfinite(masked).tolist() == [
        [True, True, False, False],
        [True, True, True, True],
        [False, True, True, False],
    ]
    assert torch.equal(masked[torch.isfinite(masked)], logits[torch.isfinite(masked)])


def test_mixed_top_k_top_p_rows_draw_as_alone() -> None:
    logits = logits_for(4, seed=21)
    rows = [
        row(seed=1, top_k=3),
        row(seed=2, top_p=0.6),
        row(seed=3, top_k=10, top_p=0.8, min_p=0.05),
        row(seed=4, temperature=1.7),
    ]
    together = Sampler()(logits, rows).token_ids
    alone = [Sampler()(logits[j : j + 1], [rows[j]]).token_ids[0] for j in range(4)]
    assert together == alone
    assert together[0] in logits[0].topk(3).indices.tolist()


def test_min_p() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    # Threshold 0.2 * 0.5 = 0.1: token 3 (0.05) goes, the rest stay.
    masked = apply_min_p(logits, torch.tensor([0.2]))
    assert torch.isfinite(masked).tolist() == [[True, True, True, False]]
    freq = frequencies(logits, 10_000, min_p=0.2)
    assert freq[3] == 0 and abs(freq[2].item() - 0.15 / 0.95) < 0.02


def expected_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The formulas, written out token by token."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        for t in range(logits.shape[1]):
            count = r.output_token_ids.count(t)
            x = out[i, t].item()
            if t in r.output_token_ids or t in r.prompt_token_ids:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            out[i, t] = x
    return out


def test_penalties_match_the_formulas() -> None:
    logits = logits_for(4, seed=11, vocab=16)
    rows = [
        row(prompt=[1, 2, 2, 9], out=[3, 3, 3, 9, 12], repetition_penalty=1.7),
        row(prompt=[1, 2], out=[3, 3, 5], presence_penalty=0.5, frequency_penalty=0.25),
        row(
            prompt=[0, 15],
            out=[15, 4, 4],
            repetition_penalty=0.8,
            presence_penalty=-1.0,
            frequency_penalty=1.5,
        ),
        row(prompt=[1], out=[1, 2]),  # no penalties: unchanged
    ]
    got = apply_penalties(logits, rows)
    assert torch.allclose(got, expected_penalties(logits, rows), atol=1e-6)
    assert torch.equal(got[3], logits[3])
    assert apply_penalties(logits, [rows[3]] * 4) is logits  # nothing to do: no copy


def _dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The penalties over whole [N, V] tensors of counts and masks (what the sampler computed before it
    touched only the seen tokens): the same arithmetic on every element."""
    vocab = logits.shape[1]
    counts = torch.zeros_like(logits)
    seen = torch.zeros(logits.shape, dtype=torch.bool)
    for i, r in enumerate(rows):
        for t in r.output_token_ids:
            counts[i, t] += 1
        for t in r.prompt_token_ids + r.output_token_ids:
            seen[i, t] = r.params.repetition_penalty != 1.0
    p = torch.tensor([r.params.repetition_penalty for r in rows])[:, None].expand(-1, vocab)
    x = torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)
    pres = torch.tensor([r.params.presence_penalty for r in rows])[:, None]
    fr = torch.tensor([r.params.frequency_penalty for r in rows])[:, None]
    return x - fr * counts - pres * (counts > 0).to(x.dtype)


def test_penalties_equal_the_dense_form_bit_for_bit() -> None:
    rng = random.Random(3)
    vocab = 5000
    logits = logits_for(6, seed=12, vocab=vocab) * 4
    logits[0, :100] = float("-inf")  # masked before (logit_bias, a grammar): stays -inf
    rows = [
        row(
            prompt=[rng.randrange(vocab) for _ in range(300)] + list(range(50)),
            out=[rng.randrange(200) for _ in range(80)],  # repeats: counts above 1
            repetition_penalty=rng.choice([0.7, 1.05, 1.3]),
            presence_penalty=rng.choice([0.0, 0.4, -0.5]),
            frequency_penalty=rng.choice([0.0, 0.3]),
        )
        for _ in range(5)
    ] + [row(prompt=[1, 2], out=[3])]  # a row without penalties beside them
    before = logits.clone()
    got = apply_penalties(logits, rows)
    assert torch.equal(got, _dense_penalties(logits, rows))
    assert torch.equal(logits, before)  # the caller's logits stay as they were
    assert torch.equal(got[5], logits[5])


def test_repetition_penalty_changes_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.5, -1.0, 0.0]])
    assert Sampler()(logits, [row(temperature=0.0, out=[0])]).token_ids == [0]
    penalised = Sampler()(logits, [row(temperature=0.0, out=[0], prompt=[2], repetition_penalty=1.5)])
    assert penalised.token_ids == [1]  # 3.0 / 1.5 = 2.0 < 2.5 (and token 2: -1.0 * 1.5)


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0, 1.0]])  # eos=1 best, then stop token 2, then 3
    sampler = Sampler()

    def greedy(out: list[int], **params: Any) -> int:
        return sampler(logits, [row(temperature=0.0, out=out, eos=1, **params)]).token_ids[0]

    assert greedy([5, 5], min_tokens=3, stop_token_ids=[2]) == 3
    assert greedy([5, 5, 5], min_tokens=3, stop_token_ids=[2]) == 1  # reached: nothing masked
    assert greedy([], min_tokens=3) == 2
    # ignore_eos: eos does not stop the row, so min_tokens has no reason to mask it.
    assert greedy([], min_tokens=3, ignore_eos=True) == 1
    assert greedy([], min_tokens=3, ignore_eos=True, stop_token_ids=[1]) == 2


def test_logprobs() -> None:
    logits = logits_for(3, seed=13)
    rows = [
        row(seed=1, logprobs=5, temperature=0.8, repetition_penalty=1.5, out=[int(logits[0].argmax())]),
        row(seed=2),
        row(seed=3, logprobs=0, temperature=0.0),
    ]
    out = Sampler()(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)  # raw: before penalties and temperature
    first = out.logprobs[0]
    assert first is not None and out.logprobs[1] is None
    top5 = set(reference[0].topk(5).indices.tolist())
    assert set(first) == top5 | {out.token_ids[0]}
    assert len(first) in (5, 6)
    for token, value in first.items():
        assert math.isclose(value, reference[0, token].item(), abs_tol=1e-5)
    assert out.logprobs[2] == pytest.approx({out.token_ids[2]: reference[2, out.token_ids[2]].item()})


def test_sampled_token_outside_top_k_logprobs_is_added() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]])
    # Repetition penalty pushes greedy off the raw top-1, which is the only logprob asked for.
    out = Sampler()(logits, [row(temperature=0.0, logprobs=1, out=[0], prompt=[], repetition_penalty=4.0)])
    assert out.token_ids == [1]
    reference = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0] == pytest.approx({0: reference[0].item(), 1: reference[1].item()})


def test_batch_shape_checks() -> None:
    empty = Sampler()(torch.zeros(0, V), [])
    assert empty.token_ids == [] and empty.logprobs == []
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.zeros(2, V), [row()])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_draws_match_cpu() -> None:
    # The noise is exact integer hashing: a stream resumed on another device continues identically.
    logits = logits_for(16, seed=17, vocab=4096)
    rows = [
        row(seed=s, out=[1] * s, temperature=0.7 + s / 10, top_k=[0, 50][s % 2], top_p=[1.0, 0.9][s % 3 % 2])
        for s in range(16)
    ]
    cpu = Sampler()(logits, rows)
    cuda = Sampler()(logits.cuda(), rows)
    assert cpu.token_ids == cuda.token_ids
    q_cpu = exponential_noise(list(range(16)), list(range(16)), 4096, torch.device("cpu"))
    q_cuda = exponential_noise(list(range(16)), list(range(16)), 4096, torch.device("cuda"))
    assert torch.allclose(q_cpu, q_cuda.cpu(), rtol=1e-6, atol=0)
