"""What crosses the pipe between an engine core and its client: small picklable records, torch-free.

Client -> core: ``AddRequest`` (answered by a ``Reply``), ``AbortRequest``, ``Inspect`` (answered),
``Shutdown``. Core -> client: ``Ready`` once, then a ``StepMessage`` per step (or per change of load
while idle), ``Reply`` to the commands that ask for one, and ``CoreDied`` if its loop fails.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.metrics import RequestRecord, SchedulerStats, StepRecord

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    seq: int  # the Reply carries it back
    request_id: str
    prompt: list[int] | str
    params: SamplingParams
    priority: int = 0
    resume_token_ids: list[int] | None = None
    resume_by_index: Mapping[int, Sequence[int]] | None = None
    indexes: Sequence[int] | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Inspect:
    """A read-only question about the core's state, between steps (tests and tools)."""

    seq: int
    what: str  # see engine.core.proc.INSPECTIONS


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Ready:
    model_path: str  # the local checkpoint: the client loads the same tokenizer from it
    max_model_len: int
    load: SchedulerStats
    description: str  # for the client's start-up log line


@dataclass(frozen=True)
class Reply:
    seq: int
    value: Any = None
    error: BaseException | None = None


@dataclass
class StepMessage:
    outputs: list[RequestOutput] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    finished: list[RequestRecord] = field(default_factory=list)
    load: SchedulerStats | None = None  # the load after this step (None: unchanged)


@dataclass(frozen=True)
class CoreDied:
    error: str  # the traceback, as text: the exception itself may not pickle
