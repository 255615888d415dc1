"""The sampler's C++ CPU kernels (engine/kernels/cpu/sampling.cpp) against its torch definitions: the
exponential race (the same scores bit for bit on both vector paths, the same winners, the sampler
drawing through it) and the top-p nucleus (the same tokens kept as the sort's, ties kept whole)."""

from __future__ import annotations

import pytest
import torch

from bench.sampler_bench import sorted_top_p
from engine.kernels import cpu as cpu_kernels
from engine.sampling import race as race_mod
from engine.sampling.sampler import Sampler, SamplingRow, apply_top_p, exponential_noise, row_keys
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.load() and torch.ops.inflight_cpu.exponential_race_supported()),
    reason="no C++ CPU kernels here, or the CPU has neither AVX-512 nor AVX2, or torch has no MKL",
)

CPU = torch.device("cpu")
# 0: the best vector code here (AVX-512 where the CPU has it), 2: AVX2, run on the same host.
ISAS = [0, 2]


def _case(rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[int], list[int]]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 4
    seeds = [int(s) for s in torch.randint(0, 2**62, (rows,), generator=g)]
    steps = [int(s) for s in torch.randint(0, 5000, (rows,), generator=g)]
    return logits, seeds, steps


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("rows", "vocab"), [(5, 49152), (3, 151936), (4, 1000), (2, 17), (1, 1)])
def test_scores_bit_for_bit(isa, rows, vocab):
    # 17 and 1000: tails shorter than a vector; 1: a vocabulary of one token.
    logits, seeds, steps = _case(rows, vocab, vocab)
    logits[0, vocab // 2] = float("-inf")  # a masked token scores -inf
    want = logits - exponential_noise(seeds, steps, vocab, CPU).log()
    scores = torch.empty_like(logits)
    keys = torch.tensor(row_keys(seeds, steps), dtype=torch.int64)
    tokens = torch.ops.inflight_cpu.exponential_race(logits, keys, scores, isa)
    assert torch.equal(scores, want)  # every value, not just the winners
    assert torch.equal(tokens, want.argmax(dim=-1))


@pytest.mark.parametrize("isa", ISAS)
def test_winners_and_torch_argmax_semantics(isa):
    logits, seeds, steps = _case(6, 4096, 7)
    logits[1] = float("-inf")
    logits[1, 4095] = 0.0  # one allowed token: it must win
    logits[2, 9] = float("nan")  # NaN counts as the maximum, as in torch.argmax
    keys = torch.tensor(row_keys(seeds, steps), dtype=torch.int64)
    got = torch.ops.inflight_cpu.exponential_race(logits, keys, None, isa)
    assert got.tolist()[1:3] == [4095, 9]
    want = (logits - exponential_noise(seeds, steps, 4096, CPU).log()).argmax(dim=-1)
    assert torch.equal(got, want)
    # Strided rows (a slice of a wider tensor) read as their own rows.
    wide = torch.zeros(6, 5000)
    wide[:, :4096] = logits
    assert torch.equal(torch.ops.inflight_cpu.exponential_race(wide[:, :4096], keys, None, isa), got)


def test_refuses_bad_input():
    keys = torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.inflight_cpu.exponential_race(torch.zeros(2, 8, dtype=torch.float64), keys)
    with pytest.raises(RuntimeError, match="keys"):
        torch.ops.inflight_cpu.exponential_race(torch.zeros(3, 8), keys)
    with pytest.raises(RuntimeError, match="isa"):
        torch.ops.inflight_cpu.exponential_race(torch.zeros(2, 8), keys, None, 1)


def test_sampler_draws_through_the_kernel(monkeypatch):
    """The sampler's random rows go through the kernel and draw what the torch definition draws."""
    vocab = 3000
    logits, _, _ = _case(8, vocab, 11)
    rows = [
        SamplingRow(SamplingParams(temperature=0.7 + 0.1 * i, seed=100 + i), [1, 2, 3], [5] * i, seed=100 + i)
        for i in range(8)
    ]
    calls = []
    real = torch.ops.inflight_cpu.exponential_race

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(race_mod, "_cpu_race", counted)
    got = Sampler().sample(logits, rows).tokens
    assert calls == [torch.Size([8, vocab])]
    scaled = logits / torch.tensor([r.params.temperature for r in rows])[:, None]
    noise = exponential_noise([r.seed for r in rows], [r.num_output_tokens for r in rows], vocab, CPU)
    assert torch.equal(got, (scaled - noise.log()).argmax(dim=-1))


def test_sampler_bench_prints_both_paths(capsys):
    from bench import sampler_bench

    assert sampler_bench.main(["--rows", "1,3", "--vocab", "1000", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "torch/kernel" in lines[1] and "sort/kernel" in lines[5]
    for rows in (lines[2:4], lines[6:8]):  # the race, then top-p: one line a row count, both timed
        assert [line.split()[0] for line in rows] == ["1", "3"]
        assert all(float(line.split()[1]) > 0 and float(line.split()[2]) > 0 for line in rows)


@pytest.mark.parametrize(
    ("vocab", "scale"), [(49152, 3.0), (49152, 0.5), (151936, 2.0), (1000, 6.0), (17, 1.0)]
)
def test_top_p_keeps_the_sorts_nucleus(vocab, scale):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=g) * scale  # no ties: the sort's choice is the nucleus
    top_p = torch.rand(12, generator=g) * 0.98 + 0.01
    top_p[0] = 1.0  # the whole row stays (the sort's float32 running sum can reach 1 before the end)
    top_p[1] = 1e-6  # only the most likely token
    logits[2, : vocab // 2] = float("-inf")  # masked earlier (top-k, a grammar): stays masked
    got = apply_top_p(logits, top_p)
    want = sorted_top_p(logits, top_p)
    assert torch.equal(torch.isinf(got[1:]), torch.isinf(want[1:]))
    assert torch.equal(got[~torch.isinf(got)], logits[~torch.isinf(got)])  # kept logits unchanged
    assert int((~torch.isinf(got[1])).sum()) == 1
    assert not torch.isinf(got[0]).any()


def test_top_p_keeps_a_tie_at_the_threshold_whole():
    # probs 0.4, 0.2, 0.2, 0.2 (two tied tokens of 0.2 after the first): top_p 0.5 reaches into the tie,
    # and both tied tokens at the threshold stay (the sort would keep one, by its order).
    logits = torch.log(torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]))
    got = apply_top_p(logits, torch.tensor([0.5]))
    assert (~torch.isinf(got)).tolist() == [[True, True, True, False, False]]


def test_top_p_refuses_bad_input():
    with pytest.raises(RuntimeError, match="top_p"):
        torch.ops.inflight_cpu.top_p_mask_(torch.zeros(2, 8), torch.ones(3))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.inflight_cpu.top_p_mask_(torch.zeros(2, 8, dtype=torch.float64), torch.ones(2))
