"""Workload generators: rates and burstiness as specified, seeds reproducible, traces parsed."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from pathlib import Path

import pytest

from inflight.plan.workload import (
    LengthMix,
    RequestSpec,
    arrival_times,
    describe,
    load_trace,
    save_trace,
    synthetic,
)


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise([0.0, *times])]


def test_poisson_rate_and_cv() -> None:
    gaps = _gaps(arrival_times(6000, 5.0, seed=1))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(gaps) / mean == pytest.approx(1.0, rel=0.06)


@pytest.mark.parametrize("cv", [0.5, 2.0, 3.0])
def test_gamma_rate_and_cv(cv: float) -> None:
    gaps = _gaps(arrival_times(8000, 2.0, process="gamma", cv=cv, seed=2))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.5, rel=0.08)
    assert statistics.pstdev(gaps) / mean == pytest.approx(cv, rel=0.12)


def test_burst_and_bad_arguments() -> None:
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_times(2, 1.0, process="burst") == [0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        arrival_times(2, 0.0)
    with pytest.raises(ValueError, match="process"):
        arrival_times(2, 1.0, process="uniform")
    with pytest.raises(ValueError, match="cv"):
        arrival_times(2, 1.0, process="gamma", cv=0)


def test_synthetic_reproducible_and_rate_only_moves_arrivals() -> None:
    a = synthetic(50, 2.0, 1000, seed=7)
    assert a == synthetic(50, 2.0, 1000, seed=7)
    assert a != synthetic(50, 2.0, 1000, seed=8)
    b = synthetic(50, 4.0, 1000, seed=7)
    assert [(s.prompt_token_ids, s.max_tokens) for s in a] == [(s.prompt_token_ids, s.max_tokens) for s in b]
    # Exponential gaps scale exactly with 1/rate under the same seed.
    for x, y in zip(a, b, strict=True):
        assert y.arrival == pytest.approx(x.arrival / 2)
    assert all(x.arrival <= y.arrival for x, y in itertools.pairwise(a))


def test_lengths_follow_the_mix() -> None:
    mix = LengthMix(short_prompt=(16, 128), long_prompt=(256, 512), long_fraction=0.25, output=(8, 256))
    specs = synthetic(2000, 1.0, 8192, mix=mix, seed=3)
    prompts = [s.num_prompt_tokens for s in specs]
    assert all(16 <= p <= 128 or 256 <= p <= 512 for p in prompts)
    assert sum(p >= 256 for p in prompts) / len(prompts) == pytest.approx(0.25, abs=0.03)
    outs = [s.max_tokens for s in specs]
    assert min(outs) >= 8 and max(outs) <= 256
    # Log-uniform: the median sits near the geometric mean of the range, sqrt(8 * 256) ~ 45.
    assert 35 <= statistics.median(outs) <= 57
    assert all(4 <= t < 8192 for s in specs for t in s.prompt_token_ids)
    with pytest.raises(ValueError):
        LengthMix(output=(0, 4))


def test_trace_parsing(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [
        "# a comment, then a blank line",
        "",
        json.dumps({"timestamp": 10.5, "prompt_len": 5, "output_len": 3, "id": "late"}),
        json.dumps({"arrival": 10.0, "prompt": "hello world", "max_tokens": 2}),
        json.dumps({"arrival": 10.25, "prompt_token_ids": [7, 8, 9], "output_len": 1, "id": "ids"}),
    ]
    path.write_text("\n".join(lines) + "\n")
    specs = load_trace(path, 100, encode=lambda text: [ord(c) % 100 for c in text], time_scale=2.0)
    assert [s.request_id for s in specs] == ["trace-4", "ids", "late"]  # arrival order
    assert [s.arrival for s in specs] == [0.0, 0.5, 1.0]  # from the earliest, times two
    assert specs[0].prompt_token_ids == tuple(ord(c) % 100 for c in "hello world")
    assert specs[1].prompt_token_ids == (7, 8, 9)
    assert specs[2].num_prompt_tokens == 5 and specs[2].max_tokens == 3
    # Seeded random tokens for a prompt_len: the same file gives the same prompt.
    again = load_trace(path, 100, encode=lambda text: [1])
    assert again[2].prompt_token_ids == specs[2].prompt_token_ids


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("{not json", r"t.jsonl:1: not JSON"),
        ('{"prompt_len": 3, "output_len": 1}', "arrival"),
        ('{"arrival": 0, "prompt_len": 3}', "output_len"),
        ('{"arrival": 0, "output_len": 2}', "prompt"),
        ('{"arrival": 0, "prompt": "x", "output_len": 2}', "tokenizer"),
        ('{"arrival": 0, "prompt_token_ids": [1, 500], "output_len": 2}', "ids < 100"),
    ],
)
def test_trace_errors_name_the_line(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=match):
        load_trace(path, 100)


def test_trace_round_trip(tmp_path: Path) -> None:
    specs = synthetic(20, 3.0, 500, process="gamma", cv=2.0, seed=4)
    save_trace(specs, tmp_path / "w.jsonl")
    back = load_trace(tmp_path / "w.jsonl", 500)
    assert [(s.request_id, s.prompt_token_ids, s.max_tokens) for s in back] == [
        (s.request_id, s.prompt_token_ids, s.max_tokens) for s in specs
    ]
    first = specs[0].arrival
    assert [s.arrival for s in back] == pytest.approx([s.arrival - first for s in specs])


def test_describe() -> None:
    specs = [RequestSpec("a", 0.0, (5, 6), 4), RequestSpec("b", 2.0, (5, 6, 7, 8), 8)]
    d = describe(specs)
    assert d["num_requests"] == 2 and d["prompt_tokens_mean"] == 3 and d["output_tokens_max"] == 8
    assert d["offered_rate"] == 0.5
