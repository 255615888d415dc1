"""The step-cost model as the engine evaluates it: a run of decode steps in closed form, the longest
chunk a step bound holds, padded rows charged, JSON that round-trips and rejects unknown fields.
(Fitting it is the planner's: tests/plan/test_fit.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.cost_model import StepCostModel


def test_decode_run_time_is_the_sum_of_its_steps() -> None:
    m = StepCostModel(0.003, 4e-5, 2e-4, 3e-6)
    steps = sum(m.step_time(16, 16, 4000 + 16 * k) for k in range(25))
    assert m.decode_run_time(16, 4000, 25) == pytest.approx(steps, rel=1e-12)


def test_max_chunk() -> None:
    m = StepCostModel(0.010, 1e-4, 0.0, 1e-6)
    # 10 decodes at context 100 each plus a chunk of a prompt with 200 tokens computed: 20 ms holds
    # 10 ms fixed + 1 ms of tokens + 1 ms of decode context + 0.2 ms of cached context + n * 101 us,
    # so n = floor(7.8 / 0.101) = 77.
    n = m.max_chunk(0.020, 10, 10, 1000, 200)
    assert n == 77
    assert m.step_time(10 + n, 11, 1200 + n) <= 0.020 < m.step_time(10 + n + 1, 11, 1200 + n + 1)
    assert m.max_chunk(0.005, 10, 10, 1000, 0) < 0


def test_json_round_trip_and_rejects_unknown_fields(tmp_path: Path) -> None:
    m = StepCostModel(
        0.001, 2e-5, 0.0, 1e-7, 0.004, host={"cpu": "x"}, engine={"block_size": 16}, fit={"rel_rms": 0.1}
    )
    m.save(tmp_path / "c.json")
    assert StepCostModel.load(tmp_path / "c.json") == m
    # A model saved before first_shape existed loads with none.
    old = m.to_json()
    del old["first_shape"]
    assert StepCostModel.from_json(old).first_shape == 0.0
    raw = json.loads((tmp_path / "c.json").read_text())
    raw["per_flop"] = 1.0
    with pytest.raises(ValueError, match="per_flop"):
        StepCostModel.from_json(raw)
    with pytest.raises(ValueError, match="fixed"):
        StepCostModel(-1.0, 0.0, 0.0, 0.0)


def test_padded_rows_are_charged() -> None:
    """An engine that rounds a step's rows up to 16 computes 32 rows for 17 tokens: the model charges
    what it computes, up to the padding's limit, and keeps the padding through JSON."""
    m = StepCostModel(0.004, 1e-4, 2e-4, 3e-6, row_grain=16, row_limit=512)
    assert m.rows(17) == 32 and m.rows(600) == 600
    assert m.step_time(17, 1, 17) == m.step_time(32, 1, 17)
    assert m.step_time(600, 1, 0) == pytest.approx(0.004 + 600 * 1e-4 + 2e-4)  # past the limit: as is
    again = StepCostModel.from_json(json.loads(json.dumps(m.to_json())))
    assert (again.row_grain, again.row_limit) == (16, 512) and again == m


def test_scaled_multiplies_every_term() -> None:
    m = StepCostModel(0.004, 1e-4, 2e-4, 3e-6, first_shape=0.01)
    s = m.scaled(1.5)
    assert s.step_time(40, 3, 900) == pytest.approx(1.5 * m.step_time(40, 3, 900), rel=1e-12)
    assert s.first_shape == pytest.approx(0.015)
