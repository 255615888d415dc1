"""Step-time variability: the simulator's AR(1) factor has mean 1 and the measured correlation, the
fit recovers both from served steps, and noise widens the tails while leaving throughput alone."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from engine.cost_model import StepCostModel
from inflight.plan.fit import NoiseFit, StepSample, fit, fit_noise, level_log_std
from inflight.plan.noise import SpeedTrace, StepNoise
from inflight.plan.simulate import FleetConfig, SimRequest, simulate
from inflight.plan.traffic import synthetic

COST = StepCostModel(
    0.010,
    1e-4,
    2e-4,
    1e-6,
    engine={"max_num_seqs": 16, "max_num_batched_tokens": 256, "block_size": 16, "num_blocks": 2048},
)


def test_factor_has_mean_one_and_the_given_correlation() -> None:
    noise = StepNoise(0.3, 0.6, seed=1)
    xs = [noise.step() for _ in range(40_000)]
    assert statistics.fmean(xs) == pytest.approx(1.0, abs=0.02)
    logs = [math.log(x) for x in xs]
    assert statistics.pstdev(logs) == pytest.approx(0.3, rel=0.05)
    assert statistics.correlation(logs[:-1], logs[1:]) == pytest.approx(0.6, abs=0.03)
    runs = [noise.run(k) for k in (5, 200) for _ in range(4000)]
    assert statistics.fmean(runs) == pytest.approx(1.0, abs=0.02)
    # A long run's mean varies far less than one step.
    assert statistics.pstdev(runs[4000:]) < 0.5 * statistics.pstdev(xs)
    assert StepNoise(0.0, 0.5, seed=1).step() == 1.0 == StepNoise(0.0, 0.5, seed=1).run(100)


def served_steps(noise: StepNoise, count: int, seed: int) -> list[StepSample]:
    """``count`` steps of random shapes in order, each the model's time times the noise's factor."""
    rng = random.Random(seed)
    steps = []
    for _ in range(count):
        n, s = rng.randint(1, 256), rng.randint(1, 16)
        steps.append(StepSample(n, s, n * 4, COST.step_time(n, s, n * 4) * noise.step()))
    return steps


def test_fit_recovers_the_variability_of_served_steps() -> None:
    steps = served_steps(StepNoise(0.25, 0.7, seed=2), 3000, seed=3)
    got = fit_noise(COST, steps)
    assert got.sigma == pytest.approx(0.25, rel=0.1)
    # One AR(1) process: whatever parts the fit picks imply its autocorrelation, 0.7^k.
    for k in (1, 5, 20):
        implied = got.slow_share * got.slow_phi**k + (1 - got.slow_share) * got.phi**k
        assert implied == pytest.approx(0.7**k, abs=0.05), k
    model = fit(steps, noise_samples=steps)
    assert model.noise_sigma > 0 and model.noise_phi > 0
    assert fit(steps).noise_sigma == 0.0  # no served steps given: no noise


def test_two_parts_are_told_apart_and_the_slow_one_persists_through_long_runs() -> None:
    # Half the variance fast (lag-1 0.5), half slow (0.98): the fit finds both from 4,000 steps.
    steps = served_steps(StepNoise(0.3, 0.5, seed=5, slow_share=0.5, slow_phi=0.98), 4000, seed=6)
    got = fit_noise(COST, steps)
    assert got.sigma == pytest.approx(0.3, rel=0.15)
    assert 0.3 <= got.slow_share <= 0.7 and got.slow_phi >= 0.95 and got.phi <= 0.7
    # Long runs: with a slow part, the mean factors of consecutive 100-step runs stay correlated and
    # vary more than with the same variance all fast; both have mean 1.
    for share, low, high in ((0.0, -0.1, 0.1), (0.8, 0.4, 0.9)):
        n = StepNoise(0.3, 0.5, seed=7, slow_share=share, slow_phi=0.995)
        runs = [math.log(n.run(100)) for _ in range(3000)]
        assert statistics.fmean(math.exp(r) for r in runs) == pytest.approx(1.0, abs=0.03)
        assert low <= statistics.correlation(runs[:-1], runs[1:]) <= high
    fast_only = StepNoise(0.3, 0.5, seed=8)
    slow = StepNoise(0.3, 0.5, seed=8, slow_share=0.8, slow_phi=0.995)
    spread = [statistics.pstdev([x.run(100) for _ in range(2000)]) for x in (fast_only, slow)]
    assert spread[1] > 3 * spread[0]


def test_a_long_run_draws_what_its_steps_would() -> None:
    # run(k) draws the mean of k steps in one go: its mean and spread match k single steps'.
    one = StepNoise(0.25, 0.6, seed=9, slow_share=0.5, slow_phi=0.97)
    many = StepNoise(0.25, 0.6, seed=10, slow_share=0.5, slow_phi=0.97)
    jumped = [math.log(one.run(64)) for _ in range(3000)]
    stepped = [math.log(sum(many.step() for _ in range(64)) / 64) for _ in range(3000)]
    assert statistics.fmean(jumped) == pytest.approx(statistics.fmean(stepped), abs=0.02)
    assert statistics.pstdev(jumped) == pytest.approx(statistics.pstdev(stepped), rel=0.15)


def test_noise_widens_the_tails_not_the_throughput() -> None:
    reqs = [
        SimRequest(r.arrival, r.prompt_len, r.output_len, 0)
        for r in synthetic(20.0, 60.0, process="poisson", seed=4)
    ]
    quiet = simulate(reqs, COST, FleetConfig(workers=1, max_waiting=None))
    noisy_cost = replace(COST, noise_sigma=0.3, noise_phi=0.7)
    noisy = simulate(reqs, noisy_cost, FleetConfig(workers=1, max_waiting=None))
    off = simulate(reqs, noisy_cost, FleetConfig(workers=1, max_waiting=None, noise_seed=None))
    assert off["tpot_p99_s"] == quiet["tpot_p99_s"]  # noise_seed None: exactly the model's steps
    assert noisy["tpot_p99_s"] > 1.1 * quiet["tpot_p99_s"]
    assert noisy["ttft_p99_s"] > quiet["ttft_p99_s"]
    assert noisy["output_tok_s"] == pytest.approx(quiet["output_tok_s"], rel=0.1)


def test_the_level_of_a_fit_is_as_uncertain_as_the_mean_of_its_noise() -> None:
    # All fast and uncorrelated: the mean of 1,000 steps is known to sigma / sqrt(1000).
    assert level_log_std(NoiseFit(0.25), 1000) == pytest.approx(0.25 / math.sqrt(1000))
    # Half of it slow at 0.995 a step: 1,000 steps hold a handful of independent values.
    noise = NoiseFit(0.25, 0.5, slow_share=0.5, slow_phi=0.995)
    predicted = level_log_std(noise, 1000)
    assert predicted > 5 * level_log_std(NoiseFit(0.25, 0.5), 1000)
    # The same figure measured: the spread of the mean log factor over independent 1,000-step windows.
    windows = []
    for seed in range(300):
        n = StepNoise(0.25, 0.5, seed=seed, slow_share=0.5, slow_phi=0.995)
        windows.append(statistics.fmean(math.log(n.step()) for _ in range(1000)))
    assert statistics.pstdev(windows) == pytest.approx(predicted, rel=0.15)
    # fit() records it when it measured the noise on served steps, and not otherwise.
    steps = served_steps(StepNoise(0.25, 0.5, seed=11, slow_share=0.5, slow_phi=0.99), 2000, seed=12)
    model = fit(steps, noise_samples=steps)
    assert model.fit["num_served_samples"] == 2000
    assert model.fit["level_log_std"] == pytest.approx(
        level_log_std(
            NoiseFit(model.noise_sigma, model.noise_phi, model.noise_slow_share, model.noise_slow_phi), 2000
        )
    )
    assert "level_log_std" not in fit(steps).fit


def test_a_speed_trace_reads_each_window_of_a_run() -> None:
    # Steps at 0.1 and 0.3 s (window 0), none in window 1, one at 1.2 s (window 2).
    trace = SpeedTrace.from_steps([(0.1, 0.02, 0.01), (0.3, 0.04, 0.01), (1.2, 0.01, 0.02)], 0.5)
    assert trace.times == (0.0, 1.0) and trace.factors == pytest.approx((3.0, 0.5))
    assert trace.at(0.7) == pytest.approx((3.0, 0.3))  # an empty window keeps the speed before it
    assert trace.at(5.0) == (0.5, math.inf)
    late = SpeedTrace.from_steps([(2.2, 0.02, 0.01)], 1.0)
    assert late.times == (0.0, 2.0) and late.factors == (1.0, 2.0)  # before any step: the model's


def bursts() -> list[SimRequest]:
    """Two bursts of 24 requests, at 10 s and at 30 s, over a trickle of one request a second."""
    reqs = [SimRequest(float(t), 64, 16, t) for t in range(40)]
    reqs += [SimRequest(at + 0.01 * i, 128, 16, i) for at in (10.0, 30.0) for i in range(24)]
    return sorted(reqs, key=lambda r: r.arrival)


def test_a_traced_speed_is_the_model_scaled_while_it_holds() -> None:
    reqs = bursts()
    quiet = FleetConfig(workers=1, max_waiting=None, noise_seed=None)
    scaled = simulate(reqs, COST.scaled(2.0), quiet)
    traced = simulate(reqs, COST, replace(quiet, speed=(SpeedTrace((0.0,), (2.0,)),)))
    for k in ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s", "output_tok_s"):
        assert traced[k] == pytest.approx(scaled[k], rel=1e-9), k


def test_where_a_slow_spell_falls_sets_the_tail() -> None:
    reqs = bursts()
    quiet = FleetConfig(workers=1, max_waiting=None, noise_seed=None)

    def spell(at: float) -> dict[str, float]:
        trace = SpeedTrace((0.0, at, at + 3.0), (1.0, 4.0, 1.0))
        stepped = simulate(reqs, COST, replace(quiet, speed=(trace,), fast_path=False))
        fast = simulate(reqs, COST, replace(quiet, speed=(trace,)))
        # Fast-forwarded decode runs end where the traced speed changes: the same as step by step.
        for k in ("ttft_p99_s", "tpot_p99_s", "output_tok_s"):
            assert fast[k] == pytest.approx(stepped[k], rel=0.02), k
        return fast

    on_burst, between = spell(9.9), spell(20.0)
    base = simulate(reqs, COST, quiet)
    # A spell over a burst queues the burst behind slow steps; between bursts it costs almost nothing.
    assert on_burst["ttft_p99_s"] > 2.0 * between["ttft_p99_s"]
    assert between["ttft_p99_s"] == pytest.approx(base["ttft_p99_s"], rel=0.2)
