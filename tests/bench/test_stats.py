"""Percentiles, per-request latencies, throughput and goodput on inputs with known answers."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from bench.results import RequestResult, RunResult
from bench.stats import backlog_throughput, max_sustained_rate, percentile, summarize
from inflight.plan.slo import SLO, parse_slo


def test_percentile_known_values() -> None:
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == 2.5
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_percentile_matches_numpy() -> None:
    rng = random.Random(0)
    for n in (2, 3, 10, 101):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (1, 50, 95, 99):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_request_latencies() -> None:
    r = RequestResult("a", arrival=1.0, num_prompt_tokens=10, max_tokens=4, token_times=[1.5, 1.6, 1.8, 2.1])
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.2)  # (2.1 - 1.5) / 3
    assert r.itls() == pytest.approx([0.1, 0.2, 0.3])
    assert r.e2e == pytest.approx(1.1)
    assert r.completed
    one = RequestResult("b", 0.0, 3, 1, token_times=[0.4])
    assert one.tpot is None and one.itls() == []
    short = RequestResult("c", 0.0, 3, 5, token_times=[0.4, 0.5])
    assert not short.completed


def _run() -> RunResult:
    # Four requests over 4 s; 10 output tokens in all.
    reqs = [
        RequestResult("a", 0.0, 10, 2, token_times=[0.5, 1.0]),  # ttft 0.5, tpot 0.5
        RequestResult("b", 1.0, 20, 3, token_times=[1.2, 1.3, 1.4]),  # ttft 0.2, tpot 0.1
        RequestResult("c", 2.0, 30, 4, token_times=[3.0, 3.1, 3.2, 4.0]),  # ttft 1.0, tpot 1/3
        RequestResult("d", 2.5, 40, 1, token_times=[3.5]),  # ttft 1.0, no tpot
    ]
    return RunResult("continuous", "t", 1.0, reqs)


def test_summarize_throughput_and_percentiles() -> None:
    s = summarize(_run())
    assert s["duration_s"] == 4.0
    assert s["num_completed"] == 4
    assert s["request_throughput"] == 1.0
    assert s["output_throughput"] == 2.5
    assert s["total_token_throughput"] == (10 + 100) / 4
    assert s["ttft"]["p50_ms"] == pytest.approx(750.0)  # median of 0.2, 0.5, 1.0, 1.0
    assert s["ttft"]["mean_ms"] == pytest.approx(675.0)
    assert s["tpot"]["p50_ms"] == pytest.approx(1e3 / 3)
    assert s["itl"]["p50_ms"] == pytest.approx(100.0)  # gaps .5 .1 .1 .1 .1 .8
    assert s["e2e"]["p99_ms"] == pytest.approx(1e3 * percentile([1.0, 0.4, 2.0, 1.0], 99))
    assert "goodput" not in s


def test_goodput_counts_requests_within_every_bound() -> None:
    run = _run()
    s = summarize(run, SLO(ttft_s=0.6, tpot_s=0.4))
    # a: tpot 0.5 fails; b passes; c, d: ttft 1.0 fails.
    assert s["goodput"] == 0.25 and s["slo_attainment"] == 0.25
    s = summarize(run, SLO(ttft_s=1.0))
    assert s["goodput"] == 1.0  # d has one token: no TPOT to judge
    run.requests[1].token_times.pop()  # b no longer completes its max_tokens
    assert summarize(run, SLO(ttft_s=1.0))["goodput"] == 0.75


def test_parse_slo() -> None:
    assert parse_slo(["ttft:2000", "tpot:100"]) == SLO(2.0, 0.1)
    assert parse_slo(["ttft:1.5s tpot:50ms"]) == SLO(1.5, 0.05)
    assert parse_slo(["tpot:20"]) == SLO(None, 0.02)
    assert parse_slo(["ttft:2000,tpot:100"]).describe() == "ttft:2000 tpot:100"
    for bad in (["ttft"], ["e2e:100"], ["ttft:1", "ttft:2"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_max_sustained_rate() -> None:
    assert max_sustained_rate([(1, 0.5), (2, 1.0), (4, 4.0)], 2.0) == (pytest.approx(3.0), True)
    assert max_sustained_rate([(4, 4.0), (1, 0.5)], 2.0) == (
        pytest.approx(1 + 3 * math.log(4) / math.log(8)),
        True,
    )
    assert max_sustained_rate([(1, 0.5), (2, 1.0)], 2.0) == (2, False)  # every rate passed: a lower bound
    assert max_sustained_rate([(1, 3.0), (2, 1.0)], 2.0) == (0.0, True)  # a later pass does not count
    assert max_sustained_rate([(1, 1.0), (2, math.nan)], 2.0) == (1, True)


def test_backlog_throughput() -> None:
    reqs = [
        RequestResult("a", 0.0, 5, 2, token_times=[0.5, 1.0]),
        RequestResult("b", 0.0, 5, 2, token_times=[1.5, 2.0]),
        RequestResult("c", 0.0, 5, 3, token_times=[1.0, 2.0, 3.0]),
        RequestResult("d", 0.0, 5, 4, token_times=[1.0, 3.0, 6.0, 9.0]),
    ]
    run = RunResult("static", "sat", math.inf, reqs)
    # Until two remain: the second completion at 2 s; 2 + 2 + 2 + 1 tokens delivered by then.
    assert backlog_throughput(run, 2) == pytest.approx(7 / 2)
    assert backlog_throughput(run, 0) == pytest.approx(11 / 9)  # the whole run
    assert math.isnan(backlog_throughput(run, 4))
