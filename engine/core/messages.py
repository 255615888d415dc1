"""What crosses the pipe between an engine core and its client: typed msgspec messages, torch-free.

Client -> core (``Command``): ``AddRequest`` (an ``EngineRequest`` with its prompt as token ids, answered by
``Added`` or a ``Reply`` with the refusal), ``AbortRequest``, ``StopSequence`` (the client's output processor
found a stop string), ``Inspect`` (answered by a ``Reply``), ``Shutdown``.
Core -> client (``Event``): ``Ready`` once, then a ``Step`` per step (or per change of load while idle),
``Added`` / ``Reply`` to the commands that ask, and ``CoreDied`` if its loop fails.

Every message is a msgspec Struct in a tagged union, encoded as msgpack with ``send_bytes``; nothing is
pickled, so a value that cannot be rebuilt on the other side fails where it is encoded (the one request
that sent it), never in a reader thread. The hot message, ``Step``, is encoded as arrays (no field
names) and carries each sequence's new token ids, finish reason and logprob ids (``SeqOutput``): text is
made on the client's side (engine/core/output_processor.py).
Errors cross as data (``Failure``) and become typed exceptions again on the caller's side.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.inputs import ContextLengthError, EngineRequest, PromptError, PromptLimits
from engine.metrics import RequestRecord, SchedulerStats, StepRecord
from engine.prompt_logprobs import PromptLogprobs
from engine.structured.spec import StructuredOutputError


class Failure(msgspec.Struct, frozen=True):
    """An exception as data. ``kind``: "context_length" (ContextLengthError, with ``param``), "prompt"
    (another PromptError, with ``param``), "invalid" (ValueError: the input's fault), "internal"
    (anything else: RuntimeError)."""

    kind: str
    message: str
    param: str | None = None

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        if isinstance(exc, ContextLengthError):
            return cls("context_length", str(exc), exc.param)
        if isinstance(exc, PromptError):
            return cls("prompt", str(exc), exc.param)
        if isinstance(exc, ValueError):
            return cls("invalid", str(exc), getattr(exc, "param", None))
        return cls("internal", f"{type(exc).__name__}: {exc}")

    def exception(self) -> Exception:
        """The exception the caller raises: the types the worker already maps to OpenAI errors."""
        if self.kind == "context_length":
            return ContextLengthError(self.message, self.param or "prompt")
        if self.kind == "prompt":
            return PromptError(self.message, self.param or "prompt")
        if self.kind == "invalid":
            if self.param is not None:  # a refused constraint names its field, like the others
                return StructuredOutputError(self.message, self.param)
            return ValueError(self.message)
        return RuntimeError(self.message)


# ---- client -> core ---------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True, frozen=True):
    seq: int  # the answer (Added or Reply) carries it back
    request: EngineRequest


class AbortRequest(msgspec.Struct, tag="abort", array_like=True, frozen=True):
    request_id: str


class StopSequence(msgspec.Struct, tag="stop", array_like=True, frozen=True):
    """The client's text of one sequence reached a stop string: finish it as stopped there."""

    request_id: str
    index: int
    stop: str


class Inspect(msgspec.Struct, tag="inspect", array_like=True, frozen=True):
    """A read-only question about the core's state, between steps (tests and tools)."""

    seq: int
    what: str  # see engine.core.proc.INSPECTIONS


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True, frozen=True):
    pass


Command = AddRequest | AbortRequest | StopSequence | Inspect | Shutdown


# ---- core -> client ---------------------------------------------------------------------------
class Ready(msgspec.Struct, tag="ready", array_like=True, frozen=True):
    model_path: str  # the local checkpoint: the client loads its tokenizer from it
    limits: PromptLimits  # what the core checks prompts against: the client prepares them the same way
    load: SchedulerStats
    description: str  # for the client's start-up log line


class Added(msgspec.Struct, tag="added", array_like=True, frozen=True):
    """The core took the request: the load with it queued."""

    seq: int
    request_id: str
    load: SchedulerStats


class Reply(msgspec.Struct, tag="reply", array_like=True, frozen=True):
    seq: int
    value: Any = None  # an inspection's answer: plain data (bool, int, str, lists, dicts)
    error: Failure | None = None


class SeqOutput(msgspec.Struct, array_like=True, frozen=True):
    """What the core says of one sequence in a step: its new token ids, and how it ended if it did.

    The core's whole output: token ids, finish reasons it knows itself (a stop token, length, abort,
    error) and logprob ids. Text, stop strings and the grouping of n sequences into a request's output
    are the client's (``engine.core.output_processor``).
    """

    request_id: str  # the caller's id (n > 1 sequences share it)
    index: int  # which of its n completions
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id (or the stop string the client sent)
    logprobs: list[dict[int, float]] | None = None  # one per token in token_ids
    num_output_tokens: int = 0  # cumulative
    metrics: RequestRecord | None = None  # with a finish: the sequence's record
    error: str | None = None
    error_param: str | None = None  # the request field an input error blames (a grammar that failed)
    # With the sequence's first token, when its request asks: the whole prompt's logprobs.
    prompt_logprobs: PromptLogprobs | None = None


class Step(msgspec.Struct, tag="step", array_like=True):
    outputs: list[SeqOutput] = msgspec.field(default_factory=list)
    steps: list[StepRecord] = msgspec.field(default_factory=list)
    finished: list[RequestRecord] = msgspec.field(default_factory=list)
    load: SchedulerStats | None = None  # the load after this step (None: unchanged)
    busy: bool = False  # the core steps again at once: another Step follows (the stall watch's cue)


class CoreDied(msgspec.Struct, tag="died", array_like=True, frozen=True):
    error: str  # the traceback, as text


Event = Ready | Added | Reply | Step | CoreDied


class Codec:
    """One side's encoder and decoder (msgspec reuses their buffers and type plans: keep one per side)."""

    def __init__(self, receives: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(receives)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, raw: bytes) -> Any:
        return self._decoder.decode(raw)


def client_codec() -> Codec:
    return Codec(Event)


def core_codec() -> Codec:
    return Codec(Command)


def seq_of(raw: bytes) -> int | None:
    """The ``seq`` of a command that failed to decode, if it has one: its asker gets the refusal."""
    try:
        fields = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(fields, list) and len(fields) > 1 and fields[0] in ("add", "inspect"):
        seq = fields[1]
        return seq if isinstance(seq, int) else None
    return None
