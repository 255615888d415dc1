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
those steps out and measures the cost on its own (inflight/plan/fit.py). Example on a bench-preset fit
(fixed 4 ms, 0.05 ms a token, 0.1 ms a row, 2 us a context token): 32 decodes at context 300 cost
4 + 32 * 0.05 + 32 * 0.1 + 9600 * 0.002 = 28 ms.

Pure Python (no torch): the scheduler's ``slo`` policy, the simulator and the planner all read it.
The engine only evaluates a model; fitting one to measured steps (and measuring how served steps vary
around it) is the planner's job: inflight/plan/fit.py, which ``inflight plan calibrate`` runs.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from engine.models.row_padding import RowPadding

COST_MODEL_VERSION = 1
TERMS = ("fixed", "per_token", "per_seq", "per_context")


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
