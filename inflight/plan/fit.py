"""Fitting the step-cost model (engine/cost_model.py) to measured steps: what ``inflight plan
calibrate`` runs; the engine itself only evaluates a fitted model.

The linear terms are fitted by non-negative least squares on relative error: with four terms every
subset of them is tried as the free set (16 small solves), which is exact and needs no numeric library.
The fit is then scaled so its total over the samples equals the measured total (see ``fit``). How
served steps vary around the model is fitted as the sum of two AR(1) processes (``fit_noise``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from engine.cost_model import TERMS, StepCostModel
from engine.models.row_padding import RowPadding


@dataclass(frozen=True)
class StepSample:
    num_tokens: int
    num_seqs: int
    sum_context: int
    seconds: float

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.num_tokens), float(self.num_seqs), float(self.sum_context))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for c in range(col, n + 1):
                    m[r][c] -= f * m[col][c]
    return [m[i][n] / m[i][i] for i in range(n)]


def fit_nnls(samples: Sequence[StepSample]) -> tuple[float, float, float, float]:
    """Non-negative least squares on relative error (each row weighted by 1/seconds, so a 2 ms decode
    counts as much as a 200 ms prefill): the best fit over every subset of terms left free."""
    if len(samples) < len(TERMS):
        raise ValueError(f"need at least {len(TERMS)} samples, got {len(samples)}")
    rows = [[x / s.seconds for x in s.features()] for s in samples]
    ys = [1.0 for _ in samples]
    best: tuple[float, list[float]] | None = None
    for k in range(1, len(TERMS) + 1):
        for free in itertools.combinations(range(len(TERMS)), k):
            # Normal equations on the free columns, scaled so their diagonals are 1.
            cols = [[r[j] for j in free] for r in rows]
            scale = [math.sqrt(sum(c[i] ** 2 for c in cols)) or 1.0 for i in range(k)]
            ata = [
                [sum(c[i] * c[j] for c in cols) / (scale[i] * scale[j]) for j in range(k)] for i in range(k)
            ]
            atb = [sum(c[i] * y for c, y in zip(cols, ys, strict=True)) / scale[i] for i in range(k)]
            sol = _solve(ata, atb)
            if sol is None or any(v < 0 for v in sol):
                continue
            coef = [0.0] * len(TERMS)
            for i, j in enumerate(free):
                coef[j] = sol[i] / scale[i]
            err = sum((sum(c * x for c, x in zip(coef, r, strict=True)) - 1.0) ** 2 for r in rows)
            if best is None or err < best[0]:
                best = (err, coef)
    if best is None:
        raise ValueError("no non-negative fit exists for these samples")
    fixed, per_token, per_seq, per_context = best[1]
    return fixed, per_token, per_seq, per_context


def fit_errors(model: StepCostModel, samples: Sequence[StepSample]) -> dict[str, float]:
    rel = [
        (model.step_time(s.num_tokens, s.num_seqs, s.sum_context) - s.seconds) / s.seconds for s in samples
    ]
    return {
        "rel_rms": math.sqrt(sum(e * e for e in rel) / len(rel)),
        "rel_max": max(abs(e) for e in rel),
        "num_samples": float(len(rel)),
    }


@dataclass(frozen=True)
class NoiseFit:
    """How served steps vary around the model: see StepCostModel.noise_*."""

    sigma: float = 0.0
    phi: float = 0.0
    slow_share: float = 0.0
    slow_phi: float = 0.0


# Candidate lag-1 correlations for the two parts. The slow part's are per step: 0.97 holds for about
# 30 steps (a second of 30 ms steps).
_FAST_PHIS = tuple(i / 20 for i in range(20))  # 0 .. 0.95
_SLOW_PHIS = (0.8, 0.85, 0.9, 0.93, 0.95, 0.96, 0.97, 0.98, 0.985, 0.99, 0.995)
_SHARES = tuple(i / 20 for i in range(21))
_MAX_LAG = 40


def ar1_mean_variance(sigma: float, phi: float, k: int) -> float:
    """Variance of the mean of k consecutive values of a stationary AR(1) process of standard
    deviation ``sigma`` and lag-1 correlation ``phi``."""
    if sigma <= 0 or k <= 0:
        return 0.0
    if phi == 0:
        return sigma**2 / k
    inner = (1 + phi) / (1 - phi) - 2 * phi * (1 - phi**k) / (k * (1 - phi) ** 2)
    return sigma**2 * inner / k


def level_log_std(noise: NoiseFit, num_steps: int) -> float:
    """How far the level of a model fitted on ``num_steps`` served steps may sit from the host's
    long-run level, as a standard deviation of log: the mean of the measured noise over that many
    steps. The slow part barely averages out (at a lag-1 correlation of 0.995, 1,000 steps hold about
    three independent values), so a 20 s calibration's level moves by about as much as a trace's."""
    share = min(max(noise.slow_share, 0.0), 1.0)
    fast = ar1_mean_variance(noise.sigma * math.sqrt(1 - share), noise.phi, num_steps)
    slow = ar1_mean_variance(noise.sigma * math.sqrt(share), noise.slow_phi, num_steps)
    return math.sqrt(fast + slow)


def fit_noise(model: StepCostModel, ordered: Sequence[StepSample]) -> NoiseFit:
    """The variability of log(measured / modelled) over steps in the order they ran: its standard
    deviation, and the two AR(1) parts whose summed autocorrelation, share * slow_phi^k +
    (1 - share) * phi^k, best matches the measured one at lags 1..40 (least squares over a grid;
    fewer lags when there are few steps, and one part when there are too few to tell two apart)."""
    logs = [
        math.log(s.seconds / t)
        for s in ordered
        if s.seconds > 0 and (t := model.step_time(s.num_tokens, s.num_seqs, s.sum_context)) > 0
    ]
    if len(logs) < 3:
        return NoiseFit()
    mean = sum(logs) / len(logs)
    dev = [x - mean for x in logs]
    var = sum(d * d for d in dev) / len(dev)
    if var <= 0:
        return NoiseFit()
    max_lag = min(_MAX_LAG, len(dev) // 5)

    def acf(k: int) -> float:
        return sum(dev[i] * dev[i + k] for i in range(len(dev) - k)) / (len(dev) - k) / var

    phi1 = min(max(acf(1), 0.0), 0.99)
    if max_lag < 10:
        return NoiseFit(math.sqrt(var), phi1)
    measured = [acf(k) for k in range(1, max_lag + 1)]
    lags = range(1, max_lag + 1)
    best = (math.inf, phi1, 0.0, 0.0)
    for slow_phi in _SLOW_PHIS:
        slow = [slow_phi**k for k in lags]
        for phi in _FAST_PHIS:
            if phi >= slow_phi:
                continue
            fast = [phi**k for k in lags]
            for share in _SHARES:
                err = sum(
                    (r - share * a - (1 - share) * b) ** 2
                    for r, a, b in zip(measured, slow, fast, strict=True)
                )
                if err < best[0]:
                    best = (err, phi, share, slow_phi)
    _, phi, share, slow_phi = best
    return NoiseFit(math.sqrt(var), phi, share, slow_phi if share > 0 else 0.0)


def fit(
    samples: Sequence[StepSample],
    *,
    host: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    first_shape_samples: Sequence[StepSample] = (),
    row_padding: RowPadding | None = None,
    noise_samples: Sequence[StepSample] | None = None,
) -> StepCostModel:
    """Fit the linear terms on ``samples`` (steps of token counts the process had run before) and,
    given the steps that ran a token count for the first time, ``first_shape`` as their median excess
    over the fitted model (a median: one descheduled step must not set it). ``row_padding``: the
    engine's; the token term is fitted on the rows a step computes. ``noise_samples``:
    served steps in the order they ran, to measure the variability on (default: none, no noise; a
    calibration grid repeats each shape in a tight loop and says nothing of a served sequence)."""
    padding = row_padding or RowPadding(1, 0)
    samples = [replace(s, num_tokens=padding.padded(s.num_tokens)) for s in samples]
    coef = fit_nnls(samples)
    # The relative-error fit follows the shape; queueing follows the mean step time, which descheduled
    # steps on a busy host push up. Scaled so that the predicted total equals the measured total: of
    # the served steps when there are some, since serving is what the model predicts. Leveled on
    # every sample, the model predicted a validation trace's decode and mixed steps 8% and 14-17% short
    # (each grid shape runs in a tight loop of its own), and the latencies 20-39% short; leveled on
    # the served steps, the next run's were within 16%.
    level = [replace(s, num_tokens=padding.padded(s.num_tokens)) for s in noise_samples or ()] or samples
    predicted = sum(sum(c * x for c, x in zip(coef, s.features(), strict=True)) for s in level)
    scale = sum(s.seconds for s in level) / predicted if predicted > 0 else 1.0
    fixed, per_token, per_seq, per_context = (c * scale for c in coef)
    grain, limit = padding.grain, padding.limit
    model = StepCostModel(fixed, per_token, per_seq, per_context, row_grain=grain, row_limit=limit)
    first_shape = 0.0
    if first_shape_samples:
        excess = sorted(
            s.seconds - model.step_time(s.num_tokens, s.num_seqs, s.sum_context) for s in first_shape_samples
        )
        first_shape = max(0.0, excess[len(excess) // 2])
    noise = fit_noise(model, noise_samples) if noise_samples else NoiseFit()
    errors = fit_errors(model, samples)
    errors["num_first_shape_samples"] = float(len(first_shape_samples))
    if noise_samples:
        # Pooled calibrations (workers side by side) are counted as one run: a wider band than
        # independent segments give, where the fit of the noise itself is rougher.
        errors["level_log_std"] = level_log_std(noise, len(noise_samples))
        errors["num_served_samples"] = float(len(noise_samples))
    return StepCostModel(
        fixed,
        per_token,
        per_seq,
        per_context,
        first_shape,
        host=host or {},
        engine=engine or {},
        fit=errors,
        samples=tuple((s.num_tokens, s.num_seqs, s.sum_context, s.seconds) for s in samples),
        row_grain=padding.grain,
        row_limit=padding.limit,
        noise_sigma=noise.sigma,
        noise_phi=noise.phi,
        noise_slow_share=noise.slow_share,
        noise_slow_phi=noise.slow_phi,
    )
