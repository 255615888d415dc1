"""Engine request spans from a real engine on the tiny model: timeline events, GenAI attributes, parents."""

from __future__ import annotations

import random
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import StatusCode

from engine.metrics import RequestRecord
from engine.sampling_params import SamplingParams
from services.common.engine_spans import REQUEST_SPAN, STEP_SPAN, EngineSpanExporter, sampling_attributes
from services.common.tracing import extract_http, inject_http
from tests.observability.conftest import make_engine, run_to_end


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 200) for _ in range(n)]


def _by_request(exporter: object) -> dict[str, ReadableSpan]:
    found = exporter.get_finished_spans()  # type: ignore[attr-defined]
    return {s.attributes["inflight.request_id"]: s for s in found if s.name.startswith(REQUEST_SPAN)}


def test_request_span_carries_the_timeline_and_genai_attributes(tiny_path: Path, spans) -> None:
    provider, exporter = spans
    tracer = provider.get_tracer("test")
    engine = make_engine(tiny_path, max_num_batched_tokens=16)  # 40-token prompt: chunks of 16, 16, 8
    engine_spans = EngineSpanExporter(tracer, "tiny", operation="chat")
    engine_spans.attach(engine)
    records: list[RequestRecord] = []
    engine.metrics.request_listeners.append(records.append)
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.7, top_p=0.9, seed=3)
    with tracer.start_as_current_span("worker consume") as consume:
        live = engine_spans.start("r1", otel_context.get_current(), sampling_attributes(params))
        engine.add_request("r1", _prompt(40, 1), params)
    run_to_end(engine)

    span = _by_request(exporter)["r1"]
    record = records[0]
    assert span.name == f"{REQUEST_SPAN} chat" and span.context == live.get_span_context()
    # A child of the worker's span, in its trace.
    assert span.parent is not None and span.parent.span_id == consume.get_span_context().span_id
    assert span.context.trace_id == consume.get_span_context().trace_id
    names = [e.name for e in span.events]
    assert names == ["queued", "admitted", *["prefill_chunk"] * 3, "first_token", "finished"]
    assert [e.attributes["tokens"] for e in span.events if e.name == "prefill_chunk"] == [16, 16, 8]
    times = [e.timestamp for e in span.events]
    assert times == sorted(times) and span.start_time <= times[0] and times[-1] <= span.end_time
    # Monotonic instants become epoch ns with one offset: gaps between events are preserved exactly.
    for (_, t0, _), (_, t1, _), a, b in zip(record.events, record.events[1:], times, times[1:], strict=False):
        assert abs((b - a) - (t1 - t0) * 1e9) < 2_000
    # Opened when handed over (just before the engine's arrival), closed at the engine's finish.
    assert record.finished is not None and span.end_time is not None and span.start_time is not None
    assert span.end_time == span.events[-1].timestamp
    assert span.start_time <= times[0] - (record.events[0][1] - record.arrival) * 1e9 + 2_000
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny"
    assert a["gen_ai.usage.input_tokens"] == 40 and a["gen_ai.usage.output_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.seed"] == 3
    assert a["gen_ai.request.temperature"] == 0.7 and a["gen_ai.request.top_p"] == 0.9
    assert a["inflight.latency.time_to_first_token"] == record.ttft
    assert a["inflight.latency.time_per_output_token"] == record.tpot
    assert a["inflight.latency.time_in_queue"] == record.queue_time
    assert a["inflight.latency.e2e"] == record.finished - record.arrival
    assert engine_spans.num_live == 0, "the finished record completes the live span"


def test_preemption_shows_as_preempted_then_resumed(tiny_path: Path, spans) -> None:
    provider, exporter = spans
    # Three requests of 6 blocks each in a pool of 10: someone must give its blocks back.
    engine = make_engine(tiny_path, num_blocks=10, block_size=4, max_num_seqs=3, enable_prefix_caching=False)
    EngineSpanExporter(provider.get_tracer("test"), "tiny").attach(engine)
    for i in range(3):
        engine.add_request(f"p{i}", _prompt(12, 10 + i), SamplingParams(max_tokens=12, ignore_eos=True))
    run_to_end(engine)
    assert engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    preempted = [s for s in _by_request(exporter).values() if s.attributes["inflight.num_preemptions"]]
    assert preempted
    for span in preempted:
        names = [e.name for e in span.events]
        assert names.count("preempted") == span.attributes["inflight.num_preemptions"]
        assert names.count("resumed") == names.count("preempted")
        for i, name in enumerate(names):
            if name == "preempted":
                assert "resumed" in names[i:], "every preemption is followed by a resume"
        assert names[-1] == "finished" and names.index("first_token") < names.index("finished")


def test_cancelled_request_ends_with_a_cancelled_event(tiny_path: Path, spans) -> None:
    provider, exporter = spans
    engine = make_engine(tiny_path)
    EngineSpanExporter(provider.get_tracer("test"), "tiny").attach(engine)
    engine.add_request("c1", _prompt(12, 2), SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.abort_request("c1")
    run_to_end(engine)
    span = _by_request(exporter)["c1"]
    assert [e.name for e in span.events][-1] == "cancelled"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert span.parent is None, "nobody started it: a root span from the engine's arrival"
    assert span.start_time is not None and span.start_time <= span.events[0].timestamp
    assert span.events[0].timestamp - span.start_time < 1_000_000, "queued right at arrival"
    assert span.status.status_code != StatusCode.ERROR


def test_incoming_traceparent_is_the_parent(tiny_path: Path, spans) -> None:
    provider, exporter = spans
    engine = make_engine(tiny_path)
    engine_spans = EngineSpanExporter(provider.get_tracer("test"), "tiny")
    engine_spans.attach(engine)
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    engine_spans.start("h1", extract_http({"traceparent": client}))
    engine_spans.start("refused", None)
    engine_spans.abandon("refused", "prompt too long")
    engine.add_request("h1", _prompt(8, 3), SamplingParams(max_tokens=2, ignore_eos=True))
    run_to_end(engine)
    span = _by_request(exporter)["h1"]
    assert f"{span.context.trace_id:032x}" == "0af7651916cd43dd8448eb211c80319c"
    assert span.parent is not None and f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
    refused = next(
        s for s in exporter.get_finished_spans() if s.name.startswith(REQUEST_SPAN) and s is not span
    )
    assert refused.status.status_code == StatusCode.ERROR and refused.status.description == "prompt too long"
    assert engine_spans.num_live == 0


def test_sampled_step_spans_show_the_batch(tiny_path: Path, spans) -> None:
    provider, exporter = spans
    engine = make_engine(tiny_path)
    EngineSpanExporter(provider.get_tracer("test"), "tiny", step_sample_every=2).attach(engine)
    for i in range(3):
        engine.add_request(f"s{i}", _prompt(10, 20 + i), SamplingParams(max_tokens=5, ignore_eos=True))
    run_to_end(engine)
    steps = [s for s in exporter.get_finished_spans() if s.name == STEP_SPAN]
    assert len(steps) == engine.metrics.num_steps // 2
    by_step = {r.step: r for r in engine.metrics.steps}
    for span in steps:
        record = by_step[span.attributes["inflight.step"]]
        assert span.attributes["inflight.step"] % 2 == 0 and span.parent is None
        assert list(span.attributes["inflight.batch.request_ids"]) == [rid for rid, _, _ in record.batch]
        assert (
            sum(span.attributes["inflight.batch.scheduled_tokens"])
            == span.attributes["inflight.batch.num_tokens"]
        )
        assert 0.0 <= span.attributes["inflight.kv_cache.usage"] <= 1.0


def test_a_noop_tracer_costs_no_span_and_passes_context_on(tiny_path: Path) -> None:
    engine = make_engine(tiny_path)
    engine_spans = EngineSpanExporter(trace.NoOpTracer(), "tiny")
    engine_spans.attach(engine)
    engine.add_request("n1", _prompt(8, 4), SamplingParams(max_tokens=2, ignore_eos=True))
    run_to_end(engine)  # no error, nothing recorded
    # Tracing off still honours a client's context: the no-op span carries it to the next hop.
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with trace.NoOpTracer().start_as_current_span("gateway", context=extract_http({"traceparent": client})):
        assert inject_http()["traceparent"] == client
    engine_spans.detach(engine)
    assert engine_spans.on_request not in engine.metrics.request_listeners
