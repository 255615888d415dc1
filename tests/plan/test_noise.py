"""Step-time variability: the simulator's AR(1) factor has mean 1 and the measured correlation, the
fit recovers both from served steps, and noise widens the tails while leaving throughput alone."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import replace

import pytest

from engine.cost_model import StepCostModel, StepSample, fit, fit_noise
from inflight.plan.noise import StepNoise
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


def test_fit_recovers_the_variability_of_served_steps() -> None:
    noise = StepNoise(0.25, 0.7, seed=2)
    rng = random.Random(3)
    steps = []
    for _ in range(3000):
        n, s = rng.randint(1, 256), rng.randint(1, 16)
        steps.append(StepSample(n, s, n * 4, COST.step_time(n, s, n * 4) * noise.step()))
    sigma, phi = fit_noise(COST, steps)
    assert sigma == pytest.approx(0.25, rel=0.1)
    assert phi == pytest.approx(0.7, abs=0.05)
    model = fit(steps, noise_samples=steps)
    assert model.noise_sigma > 0 and model.noise_phi > 0
    assert fit(steps).noise_sigma == 0.0  # no served steps given: no noise


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
