"""Step-time variability for the simulator: each step costs the model's time times a factor drawn
from what calibration measured (engine.cost_model: noise_sigma, noise_phi, noise_slow_*).

Why. A cost model with the right mean still predicts tails short. Served steps vary around it by
about 20-25% (the bench preset on a 2-core host: std of log(measured / modelled) 0.24), in two ways:
a fast part correlated over a few steps, and a slow one, the host drifting for seconds (measured
autocorrelation 0.72 at lag 1 but still 0.28 at lag 10 and 0.22 at lag 20, where one AR(1) process
of lag-1 correlation 0.72 has 0.04 and 0.001). A request of eight tokens that meets a run of slow
steps sets the TPOT P99 through the fast part; a request streaming for a hundred steps averages the
fast part away but not the slow one, and the waits behind a slow second set the TTFT P99.

The factor is exp(x - sigma^2 / 2), x the sum of two AR(1) processes holding the measured shares of
the variance, so its mean is 1 and the totals the fit was scaled to stay where they are.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from inflight.plan.fit import ar1_mean_variance

# Runs of more decode steps than this draw their mean factor in one go (see StepNoise.run).
_EXACT_RUN = 32


class _AR1:
    """x_t = phi x_{t-1} + e_t, stationary with standard deviation ``sigma``."""

    def __init__(self, sigma: float, phi: float, rng: random.Random) -> None:
        self.sigma, self.phi, self._rng = sigma, phi, rng
        self.x = rng.gauss(0.0, sigma) if sigma > 0 else 0.0

    def step(self) -> float:
        if self.sigma > 0:
            innovation = math.sqrt(1.0 - self.phi * self.phi) * self.sigma
            self.x = self.phi * self.x + self._rng.gauss(0.0, innovation)
        return self.x

    def mean_variance(self, k: int) -> float:
        """Variance of the mean of k consecutive values of the stationary process."""
        return ar1_mean_variance(self.sigma, self.phi, k)

    def run(self, k: int) -> float:
        """The mean of the next ``k`` values, drawn exactly given the current one (jointly with the
        last, which becomes the current one): a slow part stays where it was across a long run."""
        if self.sigma <= 0:
            return 0.0
        p, x0 = self.phi, self.x
        q2 = self.sigma**2 * (1 - p * p)  # innovation variance
        pk, p2k = p**k, p ** (2 * k)
        # Sum S of x_1..x_k and x_k given x_0: S = x0 p (1 - p^k) / (1 - p) + sum_j e_j c_j with
        # c_j = (1 - p^(k-j+1)) / (1 - p); x_k = p^k x0 + sum_j e_j p^(k-j).
        mean_sum = x0 * p * (1 - pk) / (1 - p)
        var_sum = q2 / (1 - p) ** 2 * (k - 2 * p * (1 - pk) / (1 - p) + p * p * (1 - p2k) / (1 - p * p))
        var_end = self.sigma**2 * (1 - p2k)
        cov = q2 / (1 - p) * ((1 - pk) / (1 - p) - p * (1 - p2k) / (1 - p * p))
        end_noise = math.sqrt(max(var_end, 0.0)) * self._rng.gauss(0.0, 1.0)
        rest = max(var_sum - (cov * cov / var_end if var_end > 0 else 0.0), 0.0)
        sum_noise = (cov / var_end * end_noise if var_end > 0 else 0.0) + math.sqrt(rest) * self._rng.gauss(
            0.0, 1.0
        )
        self.x = pk * x0 + end_noise
        return (mean_sum + sum_noise) / k


class StepNoise:
    def __init__(
        self, sigma: float, phi: float, seed: int, slow_share: float = 0.0, slow_phi: float = 0.0
    ) -> None:
        self.sigma = sigma
        self._rng = random.Random(seed)
        share = min(max(slow_share, 0.0), 1.0)
        self._fast = _AR1(sigma * math.sqrt(1.0 - share), phi, self._rng)
        self._slow = _AR1(sigma * math.sqrt(share), slow_phi, self._rng)

    def step(self) -> float:
        """The next step's factor."""
        if self.sigma <= 0:
            return 1.0
        return math.exp(self._fast.step() + self._slow.step() - self.sigma * self.sigma / 2)

    def until_change(self) -> float:
        """Seconds until the factor's law changes: never, for a stationary process."""
        return math.inf

    def run(self, k: int) -> float:
        """The mean factor of ``k`` consecutive steps (the simulator's fast-forwarded decode runs).
        Short runs draw each step; a long one draws the mean of the log factor over the run exactly
        (given where each part stands) and returns exp(mean - v / 2), v that mean's variance, so it
        too has mean 1."""
        if self.sigma <= 0:
            return 1.0
        if k <= _EXACT_RUN:
            return sum(self.step() for _ in range(k)) / k
        mean_log = self._fast.run(k) + self._slow.run(k)
        var = self._fast.mean_variance(k) + self._slow.mean_variance(k)
        return math.exp(mean_log - var / 2)


@dataclass(frozen=True)
class SpeedTrace:
    """A host's speed over one run, as the run measured it: from ``times[i]`` (seconds after the
    run's start) until the next, steps took ``factors[i]`` times what a cost model says.

    Why. Drawn noise reproduces how much steps vary, not when: on a shared host a slow spell that
    meets a burst of arrivals sets the TTFT P99, and the same spell between bursts costs nothing.
    Replaying the run's own speed over time puts each spell where it was, so what the simulator
    still misses is its own error, not the host's."""

    times: tuple[float, ...]
    factors: tuple[float, ...]

    @classmethod
    def from_steps(cls, steps: Iterable[tuple[float, float, float]], window_s: float) -> SpeedTrace:
        """From (start, measured, modelled) seconds of each step: per window of ``window_s``, the
        measured total over the modelled one (time-weighted, as the level the scheduler tracks). A
        window without steps keeps the factor before it (1.0 before the first step)."""
        totals: dict[int, list[float]] = {}
        for start, measured, modelled in steps:
            acc = totals.setdefault(int(start // window_s), [0.0, 0.0])
            acc[0] += measured
            acc[1] += modelled
        times, factors = [0.0], [1.0]
        for i in sorted(totals):
            measured, modelled = totals[i]
            if modelled > 0:
                times.append(i * window_s)
                factors.append(measured / modelled)
        if len(times) > 1 and times[1] == 0.0:
            times.pop(0)
            factors.pop(0)
        return cls(tuple(times), tuple(factors))

    def at(self, t: float) -> tuple[float, float]:
        """The factor at ``t`` and how long it holds from there."""
        i = max(bisect.bisect_right(self.times, t) - 1, 0)
        end = self.times[i + 1] if i + 1 < len(self.times) else math.inf
        return self.factors[i], end - t


class TracedSpeed:
    """A worker's step factors read off a SpeedTrace at its simulated time (StepNoise's interface)."""

    def __init__(self, trace: SpeedTrace, clock: Callable[[], float]) -> None:
        self.trace, self._clock = trace, clock

    def step(self) -> float:
        return self.trace.at(self._clock())[0]

    def until_change(self) -> float:
        return self.trace.at(self._clock())[1]

    def run(self, k: int) -> float:
        """The factor where the run starts: the simulator ends fast-forwarded runs where it changes."""
        return self.step()
