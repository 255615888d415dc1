"""logit_bias in the sampler: added before everything else, per row, on every device; bounded."""

from __future__ import annotations

import pytest
import torch

from engine.sampling.logit_bias import apply_logit_bias
from engine.sampling.sampler import Sampler, SamplingRow
from engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams

V = 64
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def row(seed: int = 0, **params: object) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [1, 2, 3], [], seed)  # type: ignore[arg-type]


@pytest.mark.parametrize("device", DEVICES)
def test_bias_is_added_to_the_named_tokens_of_its_row_only(device: str) -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0)).to(device)
    rows = [row(logit_bias={5: -100.0}), row(), row(logit_bias={7: 2.5, 9: 1.0, V + 3: 50.0})]
    out = apply_logit_bias(logits, rows)
    expected = logits.clone()
    expected[0, 5] -= 100.0
    expected[2, 7] += 2.5
    expected[2, 9] += 1.0  # V + 3 is past the vocabulary: skipped
    assert torch.equal(out, expected)
    assert apply_logit_bias(logits, [row(), row(), row()]) is logits  # no copy when nothing is biased


@pytest.mark.parametrize("device", DEVICES)
def test_bias_decides_the_draw_greedy_and_random(device: str) -> None:
    logits = torch.zeros(4, V, device=device)
    logits[:, 3] = 10.0  # token 3 would win every draw
    rows = [
        row(temperature=0.0, logit_bias={11: 100.0}),
        row(seed=1, temperature=1.0, logit_bias={12: 100.0}),
        row(temperature=0.0, logit_bias={3: -100.0, 13: 1.0}),
        row(temperature=0.0),
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids == [11, 12, 13, 3]
    assert logits[0, 11] == 0.0  # the caller's logits are untouched


def test_bounds() -> None:
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)})
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101.0})
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={-1: 1.0})
    assert SamplingParams(logit_bias={}).logit_bias is None
