"""Engine spans: a finished request's record becomes one span, its timeline becomes the span's events.

The engine keeps its timeline as (event, time.monotonic(), attributes) and reports a request once, when
it finishes; the span is completed then, events added with their own timestamps, so the engine thread
pays nothing per step for tracing. End = finished; start = when the caller handed the request over
(``start``), or the engine arrival for a request nobody registered:

    engine.request  ├ queued ─ admitted ─ prefill_chunk … ─ first_token ─ [preempted ─ resumed …] ─ finished ┤

Attributes follow the OpenTelemetry GenAI conventions (gen_ai.request.*, gen_ai.usage.*,
gen_ai.response.finish_reasons) plus ``inflight.latency.*`` in seconds. Whoever hands the request to
the engine (the worker) starts its span under the parent context first; a request nobody started
becomes a root span with the engine's own attributes only.

Optional step spans (one in ``step_sample_every`` steps) show a step's batch composition; they are
roots of their own traces, since a step is shared by many requests' traces.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from engine.metrics import RequestRecord, StepRecord
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.metrics import EngineStatsSource

Attributes = dict[str, AttributeValue]

REQUEST_SPAN = "engine.request"
STEP_SPAN = "engine.step"
# The engine says "finished" with reason "abort" for a cancel; a trace reader looks for "cancelled".
_CANCELLED_REASON = "abort"


def sampling_attributes(params: SamplingParams) -> Attributes:
    """gen_ai.request.* for a request's sampling parameters (unset ones left out)."""
    attrs: Attributes = {
        "gen_ai.request.temperature": float(params.temperature),
        "gen_ai.request.top_p": float(params.top_p),
    }
    if params.max_tokens is not None:
        attrs["gen_ai.request.max_tokens"] = int(params.max_tokens)
    if params.top_k is not None and params.top_k > 0:
        attrs["gen_ai.request.top_k"] = float(params.top_k)
    if params.seed is not None:
        attrs["gen_ai.request.seed"] = int(params.seed)
    if params.presence_penalty:
        attrs["gen_ai.request.presence_penalty"] = float(params.presence_penalty)
    if params.frequency_penalty:
        attrs["gen_ai.request.frequency_penalty"] = float(params.frequency_penalty)
    if params.n != 1:
        attrs["gen_ai.request.choice.count"] = int(params.n)
    if params.stop:
        attrs["gen_ai.request.stop_sequences"] = list(params.stop)
    return attrs


def request_attributes(record: RequestRecord) -> Attributes:
    """What the engine alone knows about a finished request: usage, finish reason, latencies."""
    attrs: Attributes = {
        "inflight.request_id": record.request_id,
        "gen_ai.usage.input_tokens": record.num_prompt_tokens,
        "gen_ai.usage.output_tokens": record.num_output_tokens,
        "gen_ai.usage.cache_read.input_tokens": record.num_cached_tokens,
        "gen_ai.response.finish_reasons": [record.finish_reason or "unknown"],
        "inflight.num_preemptions": record.num_preemptions,
    }
    latencies = {
        "time_in_queue": record.queue_time,
        "time_to_first_token": record.ttft,
        "time_per_output_token": record.tpot,
        "e2e": None if record.finished is None else record.finished - record.arrival,
        "time_in_prefill": _between(record.first_scheduled, record.prefill_done),
        "time_in_decode": _between(record.first_token, record.finished),
    }
    for name, seconds in latencies.items():
        if seconds is not None:
            attrs[f"inflight.latency.{name}"] = seconds
    if record.ttft is not None:
        attrs["gen_ai.response.time_to_first_chunk"] = record.ttft
    if record.priority:
        attrs["inflight.priority"] = record.priority
    return attrs


def _span_name(attrs: Attributes) -> str:
    # GenAI convention: "{operation} {model}"-like names; the engine's span keeps its own prefix so a
    # trace view tells it from the client's GenAI span.
    operation = attrs.get("gen_ai.operation.name")
    return f"{REQUEST_SPAN} {operation}" if isinstance(operation, str) else REQUEST_SPAN


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


class MonotonicClock:
    """time.monotonic() seconds -> Unix epoch nanoseconds, the clock spans are stamped in.

    The offset is re-read per conversion batch rather than fixed at start-up, so an NTP step of the wall
    clock moves spans with it instead of leaving the engine's spans off by the adjustment forever.
    """

    @staticmethod
    def offset_ns() -> int:
        return time.time_ns() - time.monotonic_ns()

    @staticmethod
    def to_epoch_ns(monotonic_s: float, offset_ns: int) -> int:
        return int(monotonic_s * 1e9) + offset_ns


class EngineSpanExporter:
    """Turns an engine's finished-request records (and sampled steps) into spans.

    ``start`` and ``abandon`` run on the caller's event loop, ``on_request`` on the engine thread: a dict
    write and a dict pop (atomic under the GIL) are their only shared state, and the SDK's span locks
    its own mutations.
    """

    def __init__(
        self,
        tracer: trace.Tracer,
        model_name: str,
        *,
        operation: str = "text_completion",
        step_sample_every: int = 0,
    ) -> None:
        if step_sample_every < 0:
            raise ValueError("step_sample_every must be >= 0 (0 = no step spans)")
        self.tracer = tracer
        self.model_name = model_name
        self.operation = operation
        self.step_sample_every = step_sample_every
        self._live: dict[str, trace.Span] = {}

    # ---- caller side --------------------------------------------------------------------------
    def start(
        self, request_id: str, parent: Context | None, attributes: Attributes | None = None
    ) -> trace.Span:
        """Open the span of engine request ``request_id`` now, under ``parent``; the engine's finished
        record completes it. Opening it before the engine runs the request lets work done meanwhile
        (publishing tokens) be its children."""
        attrs = {**self._base_attributes(attributes), "inflight.request_id": request_id}
        span = self.tracer.start_span(
            _span_name(attrs), context=parent, kind=SpanKind.INTERNAL, attributes=attrs
        )
        self._live[request_id] = span
        return span

    def abandon(self, request_id: str, reason: str) -> None:
        """End a started span the engine will never report (it refused the request before queueing it)."""
        span = self._live.pop(request_id, None)
        if span is not None:
            span.set_status(Status(StatusCode.ERROR, reason))
            span.end()

    @property
    def num_live(self) -> int:
        return len(self._live)

    # ---- engine side --------------------------------------------------------------------------
    def attach(self, engine: EngineStatsSource) -> None:
        engine.metrics.request_listeners.append(self.on_request)
        if self.step_sample_every:
            engine.metrics.step_listeners.append(self.on_step)

    def detach(self, engine: EngineStatsSource) -> None:
        if self.on_request in engine.metrics.request_listeners:
            engine.metrics.request_listeners.remove(self.on_request)
        if self.on_step in engine.metrics.step_listeners:
            engine.metrics.step_listeners.remove(self.on_step)

    def on_request(self, record: RequestRecord) -> None:
        offset = MonotonicClock.offset_ns()
        span = self._live.pop(record.request_id, None)
        if span is None:  # nobody started it (offline use): a root span from arrival
            attrs = self._base_attributes(None)
            span = self.tracer.start_span(
                _span_name(attrs),
                context=Context(),
                kind=SpanKind.INTERNAL,
                attributes=attrs,
                start_time=MonotonicClock.to_epoch_ns(record.arrival, offset),
            )
        if span.is_recording():
            span.set_attributes(request_attributes(record))
            for name, at, event_attrs in record.events:
                if name == "finished" and event_attrs.get("reason") == _CANCELLED_REASON:
                    name = "cancelled"
                span.add_event(name, dict(event_attrs), MonotonicClock.to_epoch_ns(at, offset))
            if record.finish_reason == "error":
                span.set_status(Status(StatusCode.ERROR, "the engine failed this request"))
        end = record.finished if record.finished is not None else time.monotonic()
        span.end(MonotonicClock.to_epoch_ns(end, offset))

    def _base_attributes(self, extra: Attributes | None) -> Attributes:
        return {
            "gen_ai.operation.name": self.operation,
            "gen_ai.request.model": self.model_name,
            **(extra or {}),
        }

    def on_step(self, record: StepRecord) -> None:
        if record.step % self.step_sample_every:
            return
        offset = MonotonicClock.offset_ns()
        st = record.stats
        attrs: dict[str, Any] = {
            "inflight.step": record.step,
            "inflight.batch.request_ids": [rid for rid, _, _ in record.batch],
            "inflight.batch.scheduled_tokens": [n for _, n, _ in record.batch],
            "inflight.batch.computed_tokens": [before for _, _, before in record.batch],
            "inflight.batch.num_seqs": st.num_scheduled_seqs,
            "inflight.batch.num_tokens": st.num_scheduled_tokens,
            "inflight.num_running": st.num_running,
            "inflight.num_waiting": st.num_waiting,
            "inflight.kv_cache.usage": st.kv_usage,
            "inflight.kv_cache.free_blocks": st.num_free_blocks,
            "inflight.num_preemptions": st.step_preemptions,
            "inflight.time.schedule": record.schedule_time,
            "inflight.time.prepare": record.prepare_time,
            "inflight.time.execute": record.execute_time,
            "gen_ai.request.model": self.model_name,
        }
        start = MonotonicClock.to_epoch_ns(record.start, offset)
        span = self.tracer.start_span(
            STEP_SPAN, context=Context(), kind=SpanKind.INTERNAL, attributes=attrs, start_time=start
        )
        span.end(start + int(record.duration * 1e9))
