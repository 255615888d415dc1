"""A step's wall time as a linear function of what the step computes, fitted on the host it runs on.

    T(step) = fixed + per_token * num_tokens + per_seq * num_seqs + per_context * sum_context

``num_tokens`` are the tokens scheduled (prefill chunks and decodes; where the engine rounds a step's
rows up to whole GEMM tiles, bf16 on CPU, the rows it pads to: ``row_grain``), ``num_seqs`` the rows of the
batch, ``sum_context`` the tokens each row attends over (its computed tokens plus the new ones), summed.
The terms follow what a step does: the matmuls scale with tokens, sampling and per-row bookkeeping with
rows, attention with context, and launch and Python overhead is fixed. Apart from those, ``first_shape``:
what a step pays the first time a process runs its number of tokens (kernels specialised on the shape:
oneDNN primitives, allocator growth). A served trace of random prompt lengths meets hundreds of new
token counts before it has seen them all, so on a short run most prefill steps pay it; the fit leaves
those steps out and measures the cost on its own (see ``fit``). Example on a bench-preset fit
(fixed 4 ms, 0.05 ms a token, 0.1 ms a row, 2 us a context token): 32 decodes at context 300 cost
4 + 32 * 0.05 + 32 * 0.1 + 9600 * 0.002 = 28 ms.

Pure Python (no torch): the scheduler's ``slo`` policy, the simulator and the planner all read it.
Coefficients are fitted by non-negative least squares on relative error: with four terms every subset
of them is tried as the free set (16 small solves), which is exact and needs no numeric library. The
fit is then scaled so its total over the samples equals the measured total (see ``fit``).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.models.row_padding import RowPadding

COST_MODEL_VERSION = 1
TERMS = ("fixed", "per_token", "per_seq", "per_context")


@dataclass(frozen=True)
class StepSample:
    num_tokens: int
    num_seqs: int
    sum_context: int
    seconds: float

    def features(self) -> tuple[float, float, float, float]:
        return (1.0, float(self.num_tokens), float(self.num_seqs), float(self.sum_context))


@dataclass(frozen=True)
class StepCostModel:
    fixed: float  # seconds
    per_token: float
    per_seq: float
    per_context: float
    first_shape: float = 0.0  # seconds, once per token count per process (not in the linear terms)
    # Where it was measured (CPU, flags, threads) and with which engine settings; free-form.
    host: dict[str, Any] = field(default_factory=dict)
    engine: dict[str, Any] = field(default_factory=dict)
    # Fit quality: relative RMS and worst relative error over the calibration samples.
    fit: dict[str, float] = field(default_factory=dict)
    # The calibration's samples as (num_tokens, num_seqs, sum_context, seconds): kept so a fit can be
    # checked or redone; the model itself never reads them.
    samples: tuple[tuple[int, int, int, float], ...] = ()
    # The engine's row padding (engine/models/row_padding.py): a step of n tokens computes
    # rows(n) >= n of them in its token-wise ops. grain 1: none.
    row_grain: int = 1
    row_limit: int = 0
    # How steps vary around the model, measured on served steps in the order they ran: the standard
    # deviation of log(measured / modelled) and its lag-1 autocorrelation. Not used by step_time;
    # the simulator draws each step's factor from it (tails depend on it: a request of a few tokens
    # meeting a run of slow steps sets the P99, which the mean alone never shows).
    noise_sigma: float = 0.0
    noise_phi: float = 0.0
    # The variability has two parts (a step's factor is the product of both): a fast one, correlated
    # over a few steps (noise_phi), and a slow one, the host drifting over seconds (a lag-1
    # correlation of noise_slow_phi, close to 1), holding noise_slow_share of the log variance. The
    # slow part is what a request streaming for a hundred steps cannot average away: it sets TPOT and
    # TTFT P99s. Absent (0) in models fitted before it: one AR(1) process.
    noise_slow_share: float = 0.0
    noise_slow_phi: float = 0.0

    def __post_init__(self) -> None:
        for name in (*TERMS, "first_shape"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be finite and >= 0, got {value}")
        object.__setattr__(self, "_padding", RowPadding(self.row_grain, self.row_limit))

    @property
    def padding(self) -> RowPadding:
        """The engine's row padding this model was measured with."""
        padding: RowPadding = self._padding  # type: ignore[attr-defined]
        return padding

    def rows(self, num_tokens: int) -> int:
        """The rows a step of ``num_tokens`` tokens computes (and its shape, for first_shape)."""
        return self.padding.padded(num_tokens)

    def step_time(self, num_tokens: int, num_seqs: int, sum_context: int) -> float:
        return (
            self.fixed
            + self.per_token * self.rows(num_tokens)
            + self.per_seq * num_seqs
            + self.per_context * sum_context
        )

    def max_chunk(
        self, seconds: float, num_tokens: int, num_seqs: int, sum_context: int, computed: int
    ) -> int:
        """The longest prefill chunk that a step already holding (``num_tokens``, ``num_seqs``,
        ``sum_context``) can add for a request with ``computed`` tokens in the cache while still taking
        at most ``seconds``. A chunk of n adds n tokens, one row and ``computed + n`` context.
        0 or less when even one token does not fit."""
        slope = self.per_token + self.per_context
        room = seconds - self.step_time(num_tokens, num_seqs + 1, sum_context + computed)
        if slope <= 0:
            return 1 << 30 if room >= 0 else 0
        return math.floor(room / slope + 1e-9)

    def scaled(self, factor: float) -> StepCostModel:
        """The same model on a host ``factor`` times slower: every term, the first-shape cost too."""
        terms = (*TERMS, "first_shape")
        return replace(self, **{t: getattr(self, t) * factor for t in terms})

    def decode_run_time(self, num_seqs: int, sum_context: int, num_steps: int) -> float:
        """Total time of ``num_steps`` decode-only steps of ``num_seqs`` rows, context growing by
        ``num_seqs`` a step (closed form of the arithmetic series)."""
        base = self.step_time(num_seqs, num_seqs, sum_context)
        return num_steps * base + self.per_context * num_seqs * num_steps * (num_steps - 1) / 2

    # ---- persistence -----------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"version": COST_MODEL_VERSION, **asdict(self)}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> StepCostModel:
        if raw.get("version") != COST_MODEL_VERSION:
            raise ValueError(f"cost model version {raw.get('version')!r} is not {COST_MODEL_VERSION}")
        known = {"version", *TERMS, "first_shape", "host", "engine", "fit", "samples"}
        known |= {"row_grain", "row_limit", "noise_sigma", "noise_phi", "noise_slow_share", "noise_slow_phi"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown cost model field(s): {', '.join(sorted(unknown))}")
        return cls(
            **{t: float(raw[t]) for t in TERMS},
            first_shape=float(raw.get("first_shape", 0.0)),  # absent from models fitted before it
            host=dict(raw.get("host", {})),
            engine=dict(raw.get("engine", {})),
            fit={k: float(v) for k, v in raw.get("fit", {}).items()},
            samples=tuple((int(t), int(n), int(c), float(x)) for t, n, c, x in raw.get("samples", ())),
            row_grain=int(raw.get("row_grain", 1)),  # absent: fitted before the engine padded rows
            row_limit=int(raw.get("row_limit", 0)),
            noise_sigma=float(raw.get("noise_sigma", 0.0)),
            noise_phi=float(raw.get("noise_phi", 0.0)),
            noise_slow_share=float(raw.get("noise_slow_share", 0.0)),
            noise_slow_phi=float(raw.get("noise_slow_phi", 0.0)),
        )

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        return cls.from_json(json.loads(Path(path).read_text()))


# ---- fitting -------------------------------------------------------------------------------
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
