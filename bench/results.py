"""What a benchmark run records: one row per request, one per engine step, all in seconds from the start.

Every target fills the same ``RunResult`` so the metrics, plots and trace export never care which
system produced it. Times are relative to the run's start (the instant request arrival 0.0 refers
to), taken from one monotonic clock per run.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RequestResult:
    request_id: str
    arrival: float  # when the workload says it arrived (an open-loop client sends it then)
    num_prompt_tokens: int
    max_tokens: int
    token_times: list[float] = field(default_factory=list)  # when each output token reached the caller
    first_scheduled: float | None = None  # engine targets: first step that computed any of it
    prefill_done: float | None = None  # engine targets: the step that computed its last prompt token
    finished: float | None = None
    num_preemptions: int = 0
    error: str | None = None
    # Engine targets: the engine's own lifecycle events (queued, admitted, prefill_chunk, first_token,
    # preempted, resumed, finished) as [name, time, attributes].
    events: list[tuple[str, float, dict[str, Any]]] = field(default_factory=list)
    # Engine and vllm targets: the generated token ids, so two targets' greedy outputs can be compared.
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def completed(self) -> bool:
        return self.error is None and self.num_output_tokens >= self.max_tokens

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Mean gap between output tokens after the first; None with fewer than two tokens."""
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n >= 2 else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.arrival if self.token_times else None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in itertools.pairwise(t)]


@dataclass
class StepSample:
    """One engine step as the benchmark saw it (engine targets only)."""

    step: int
    start: float
    end: float  # when step() returned to the caller: outputs detokenized and delivered
    schedule_time: float
    prepare_time: float  # packing inputs (part of execute_time)
    execute_time: float  # inputs, model and sampling
    num_running: int  # after the step
    num_waiting: int
    num_scheduled_tokens: int
    num_scheduled_seqs: int
    num_decode_seqs: int  # scheduled for exactly one token with their prompt already computed
    kv_usage: float
    num_free_blocks: int
    step_preemptions: int
    kv_slots_used: int  # blocks held * block_size, after the step
    kv_slots_empty: int  # of those, slots allocated but holding no computed token
    batch: list[tuple[str, int, int]] = field(default_factory=list)  # (id, scheduled, computed before)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def model_time(self) -> float:
        return self.execute_time - self.prepare_time

    @property
    def is_decode_only(self) -> bool:
        return self.num_scheduled_seqs > 0 and self.num_decode_seqs == self.num_scheduled_seqs


@dataclass
class RunResult:
    target: str
    label: str  # e.g. "rate=2.5" or "saturation"
    offered_rate: float  # requests/s of the workload; inf for all-at-once
    requests: list[RequestResult]
    steps: list[StepSample] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        """From the start to the last token delivered (or the last arrival, if later)."""
        ends = [r.token_times[-1] for r in self.requests if r.token_times]
        ends += [r.arrival for r in self.requests]
        return max(ends, default=0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "label": self.label,
            "offered_rate": self.offered_rate,
            "config": self.config,
            "extra": self.extra,
            "requests": [asdict(r) for r in self.requests],
            "steps": [asdict(s) for s in self.steps],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RunResult:
        steps = []
        for s in obj.get("steps", []):
            s = dict(s)
            s["batch"] = [tuple(b) for b in s.get("batch", [])]
            steps.append(StepSample(**s))
        return cls(
            target=obj["target"],
            label=obj["label"],
            offered_rate=_float(obj["offered_rate"]),
            requests=[_request(r) for r in obj["requests"]],
            steps=steps,
            config=obj.get("config", {}),
            extra=obj.get("extra", {}),
        )


def _request(obj: dict[str, Any]) -> RequestResult:
    obj = dict(obj)
    obj["events"] = [(name, t, attrs) for name, t, attrs in obj.get("events", [])]
    return RequestResult(**obj)


def _float(x: Any) -> float:
    return math.inf if x is None else float(x)


def clean_json(obj: Any) -> Any:
    """JSON has no inf/nan: write them as null so any reader can parse the file."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean_json(v) for v in obj]
    return obj


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(clean_json(obj), indent=1, allow_nan=False) + "\n", encoding="utf-8")
