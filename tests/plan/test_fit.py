"""Fitting the step-cost model: the fit recovers known coefficients and stays non-negative, first
steps of a shape are fitted apart, padded rows are fitted on; ``calibrate --quick`` fits the real
engine."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from engine.cost_model import StepCostModel
from engine.models.row_padding import RowPadding
from inflight.cli import main
from inflight.plan.fit import StepSample, fit


def _samples(truth: StepCostModel) -> list[StepSample]:
    grid = [(t, s, c) for t in (1, 8, 64, 256) for s in (1, 8, 32) for c in (64, 1024, 8192) if s <= t]
    return [StepSample(t, s, c, truth.step_time(t, s, c)) for t, s, c in grid]


def test_fit_recovers_exact_coefficients() -> None:
    truth = StepCostModel(0.004, 5e-5, 1e-4, 2e-6)
    got = fit(_samples(truth))
    for name in ("fixed", "per_token", "per_seq", "per_context"):
        assert getattr(got, name) == pytest.approx(getattr(truth, name), rel=1e-6)
    assert got.fit["rel_rms"] < 1e-9


def test_first_steps_of_a_shape_are_fitted_apart() -> None:
    # The first step of each token count costs 3 ms more (one step of them 40 ms more: descheduled).
    # Mixed into the linear fit they would bend every term; kept apart they give first_shape alone.
    truth = StepCostModel(0.004, 5e-5, 1e-4, 2e-6)
    cold = [StepSample(t, 1, t, truth.step_time(t, 1, t) + 0.003) for t in (3, 17, 99, 300)]
    cold.append(StepSample(400, 1, 400, truth.step_time(400, 1, 400) + 0.040))
    got = fit(_samples(truth), first_shape_samples=cold)
    assert got.fixed == pytest.approx(truth.fixed, rel=1e-6)
    assert got.first_shape == pytest.approx(0.003, rel=1e-6)  # the median, not the mean
    assert got.fit["num_first_shape_samples"] == 5
    assert fit(_samples(truth)).first_shape == 0.0


def test_fit_never_goes_negative() -> None:
    # Time falls with rows here (a least-squares fit would give per_seq < 0): NNLS pins it at 0.
    samples = [StepSample(t, s, 0, 0.01 + 1e-4 * t - 1e-5 * s) for t in (8, 64, 256) for s in (1, 4, 8)]
    got = fit(samples)
    assert got.per_seq == 0.0
    assert min(got.fixed, got.per_token, got.per_context) >= 0.0
    assert got.per_token == pytest.approx(1e-4, rel=0.05)


def test_calibrate_quick_fits_the_engine(
    tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cost.json"
    assert (
        main(
            [
                "plan",
                "calibrate",
                "--model",
                str(tiny_model_path),
                "--out",
                str(out),
                "--quick",
                "--max-num-seqs",
                "8",
                "--max-model-len",
                "512",
            ]
        )
        == 0
    )
    cost = StepCostModel.load(out)
    assert "relative RMS error" in capsys.readouterr().out
    assert cost.engine["max_num_batched_tokens"] == 512 and cost.engine["num_blocks"] == 8 * 512 // 16
    assert cost.host["threads"] >= 1 and cost.host["cpu"]
    assert cost.fit["num_samples"] == len(cost.samples) >= 8 and math.isfinite(cost.fit["rel_rms"])
    # A longer prefill is predicted to cost more than a one-token decode.
    assert cost.step_time(128, 1, 128) > cost.step_time(1, 1, 33)


def test_padded_rows_are_charged_and_fitted() -> None:
    """An engine that rounds a step's rows up to 16 computes 32 rows for 17 tokens: the model charges
    what it computes, fits on it, and keeps the padding through JSON."""
    truth = StepCostModel(0.004, 1e-4, 2e-4, 3e-6, row_grain=16, row_limit=512)
    assert truth.step_time(17, 1, 17) - truth.step_time(32, 1, 17) == 0.0
    assert truth.step_time(600, 1, 0) == pytest.approx(0.004 + 600 * 1e-4 + 2e-4)  # past the limit: as is
    rng = random.Random(5)
    samples = []
    for _ in range(60):
        n, s = rng.randint(1, 512), rng.randint(1, 32)
        c = n + rng.randint(0, 4000)
        samples.append(StepSample(n, s, c, truth.step_time(n, s, c)))
    model = fit(samples, row_padding=RowPadding(16, 512))
    assert model.per_token == pytest.approx(1e-4, rel=1e-6)
    assert model.fit["rel_max"] < 1e-9
    unpadded = fit(samples)  # the same steps read as if every token were a row: a worse fit
    assert unpadded.fit["rel_max"] > 1e-3
    again = StepCostModel.from_json(json.loads(json.dumps(model.to_json())))
    assert (again.row_grain, again.row_limit) == (16, 512)
    assert again.step_time(17, 2, 40) == model.step_time(17, 2, 40)
