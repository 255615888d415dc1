"""Step-time variability for the simulator: each step costs the model's time times a factor drawn
from what calibration measured (engine.cost_model: noise_sigma, noise_phi).

Why. A cost model with the right mean still predicts tails short. Served steps vary around it by
about 20% (the bench preset on a 2-core host: std of log(measured / modelled) 0.24, lag-1
correlation 0.65, gone by lag 20), and a request of eight tokens that meets a run of slow steps sets
the TPOT P99; the waits behind such runs set the TTFT P99. The factor is exp(x - sigma^2 / 2), x an
AR(1) process with that standard deviation and correlation, so its mean is 1 and the totals the fit
was scaled to stay where they are.
"""

from __future__ import annotations

import math
import random

# Runs of more decode steps than this draw their mean factor in one go (see StepNoise.run).
_EXACT_RUN = 32


class StepNoise:
    def __init__(self, sigma: float, phi: float, seed: int) -> None:
        self.sigma = sigma
        self.phi = phi
        self._rng = random.Random(seed)
        self._x = self._rng.gauss(0.0, sigma) if sigma > 0 else 0.0

    def step(self) -> float:
        """The next step's factor."""
        if self.sigma <= 0:
            return 1.0
        innovation = math.sqrt(1.0 - self.phi * self.phi) * self.sigma
        self._x = self.phi * self._x + self._rng.gauss(0.0, innovation)
        return math.exp(self._x - self.sigma * self.sigma / 2)

    def run(self, k: int) -> float:
        """The mean factor of ``k`` consecutive steps (the simulator's fast-forwarded decode runs).
        Short runs draw each step; a long one draws the mean's log directly, with the variance of
        an AR(1) process's mean over k steps, sigma^2 (1 + phi) / ((1 - phi) k) (capped at sigma^2),
        and the process restarts from a fresh draw after it."""
        if self.sigma <= 0:
            return 1.0
        if k <= _EXACT_RUN:
            return sum(self.step() for _ in range(k)) / k
        var = min(1.0, (1.0 + self.phi) / ((1.0 - self.phi) * k)) * self.sigma * self.sigma
        mean_log = self._rng.gauss(0.0, math.sqrt(var))
        self._x = self._rng.gauss(0.0, self.sigma)
        return math.exp(mean_log - var / 2)
