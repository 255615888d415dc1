"""The fused Triton sampler vs the torch sampler (engine/sampling/sampler.py), on the GPU or under the
interpreter (every tensor on the ``device`` fixture's device: Triton refuses CPU tensors on a GPU).

The noise is the sampler's bit for bit, so the two paths draw the same token for the same row,
and the kernel's draws follow the target distribution (chi-square); a row's draw depends only on
(seed, output position), whatever else shares the batch.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.sampling import exponential_noise as kernel_noise
from engine.sampling.sampler import Sampler, SamplingRow, exponential_noise, row_keys
from engine.sampling_params import SamplingParams


def _row(seed: int, out: list[int] | None = None, **params: object) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=[1, 2, 3],
        output_token_ids=out if out is not None else [],
        seed=seed,
    )


def test_noise_is_the_samplers_bit_for_bit(device):
    seeds, steps = [0, 1, 7, 2**62 + 3, 12345], [0, 0, 9, 4, 100000]
    keys = torch.tensor(row_keys(seeds, steps), dtype=torch.int64, device=device)
    got = kernel_noise(keys, 2500)  # three tiles, the last partial
    assert torch.equal(got, exponential_noise(seeds, steps, 2500, torch.device(device)))


def test_draw_for_draw_equal_to_the_torch_sampler(device):
    gen = torch.Generator().manual_seed(0)
    vocab = 300
    settings: list[dict[str, object]] = [
        {"temperature": 0.8, "top_p": 0.95},
        {"temperature": 1.3},
        {"temperature": 0.7, "top_k": 20},
        {"temperature": 1.0, "top_k": 5, "top_p": 0.6},
        {"temperature": 0.9, "min_p": 0.1},
        {"temperature": 0.0},  # greedy rows take the argmax path in both
        {"temperature": 1.0, "repetition_penalty": 1.3, "top_p": 0.9},  # penalties come before the draw
    ]
    rows = [_row(seed=i, out=[i % 5] * (i % 4), **settings[i % len(settings)]) for i in range(14)]
    logits = (torch.randn(len(rows), vocab, generator=gen) * 3).to(device)
    fused = Sampler(fused=True)(logits, rows).token_ids
    torch_path = Sampler(fused=False)(logits, rows).token_ids
    assert fused == torch_path


def test_distribution_matches_the_target(device):
    # temperature 0.8 then top-p 0.9 over 8 tokens: the nucleus's renormalised probabilities.
    logits = torch.tensor([2.0, 1.5, 1.4, 0.3, 0.0, -0.5, -1.0, -3.0])
    probs = (logits / 0.8).softmax(-1)
    order = probs.argsort(descending=True)
    kept = order[(probs[order].cumsum(0) - probs[order]) < 0.9]
    target = torch.zeros(8)
    target[kept] = probs[kept] / probs[kept].sum()
    num = 240
    rows = [_row(seed=s, temperature=0.8, top_p=0.9) for s in range(num)]
    batch = logits.expand(num, -1).contiguous().to(device)
    tokens = Sampler(fused=True)(batch, rows).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=8).float()
    assert counts[target == 0].sum() == 0, "a token outside the nucleus was drawn"
    expected = target[kept] * num
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, (chi2, counts.tolist(), expected.tolist())  # df <= 7, p ~ 0.005
    # And the same draws as the torch sampler, seed for seed.
    assert tokens == Sampler(fused=False)(batch, rows).token_ids


def test_top_k_keeps_ties_and_top_k_1_is_argmax(device):
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, -1.0], device=device)
    num = 30
    rows = [_row(seed=s, temperature=1.0, top_k=2) for s in range(num)]
    drawn = set(Sampler(fused=True)(logits.expand(num, -1).contiguous(), rows).token_ids)
    assert drawn == {0, 2, 3}  # the k-th value (2.0) is tied: both stay
    rows = [_row(seed=s, temperature=1.5, top_k=1) for s in range(8)]
    assert Sampler(fused=True)(logits.expand(8, -1).contiguous(), rows).token_ids == [0] * 8


def test_seeded_draws_independent_of_the_batch(device):
    gen = torch.Generator().manual_seed(3)
    vocab = 200
    target = torch.randn(vocab, generator=gen).to(device) * 2
    mine = _row(seed=42, out=[5, 6, 7], temperature=0.8, top_p=0.95)
    alone = Sampler(fused=True)(target[None].contiguous(), [mine]).token_ids[0]
    others = [_row(seed=s, temperature=1.2, top_k=7) for s in range(5)]
    batch = torch.randn(6, vocab, generator=gen).to(device)
    batch[3] = target
    together = Sampler(fused=True)(batch, [*others[:3], mine, *others[3:]]).token_ids[3]
    # A resumed stream: the same seed and output position, whatever tokens came before.
    resumed = Sampler(fused=True)(
        target[None].contiguous(), [_row(42, [9, 9, 9], temperature=0.8, top_p=0.95)]
    )
    assert alone == together == resumed.token_ids[0]
    # The next position draws fresh noise (a different token for most targets; here checked on noise).
    keys = torch.tensor(row_keys([42, 42], [3, 4]), dtype=torch.int64, device=device)
    q = kernel_noise(keys, vocab)
    assert not torch.equal(q[0], q[1])


@pytest.mark.gpu
def test_large_vocab_matches_torch_gpu():
    gen = torch.Generator().manual_seed(5)
    rows = [_row(seed=i, temperature=0.8, top_p=0.95, top_k=(0, 50)[i % 2]) for i in range(64)]
    logits = (torch.randn(64, 128256, generator=gen) * 4).cuda()
    fused = Sampler(fused=True)(logits, rows).token_ids
    assert fused == Sampler(fused=False)(logits, rows).token_ids
