"""One trace per request across the gateway and worker processes, and /metrics moving as requests flow.

A real stack (tansu broker, Redis, gateway and worker processes) exports its spans over OTLP/HTTP to a
receiver this test runs on loopback; the spans are decoded from the protobuf the exporters send.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.servers import start_kafka, start_redis
from tests.observability.otlp_receiver import OTLPReceiver, Span
from tests.services.stack import MODEL_NAME, REDIS_PASSWORD, Stack, new_stack, wait_for

pytestmark = pytest.mark.timeout(120)

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
SERVER, PRODUCER, CONSUMER = 2, 4, 5  # OTLP SpanKind values


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, OTLPReceiver]]:
    from engine.models.tiny import default_model_path

    tmp = tmp_path_factory.mktemp("traced")
    with (
        OTLPReceiver() as rx,
        start_kafka(workdir=tmp / "kafka") as kafka,
        start_redis(password=REDIS_PASSWORD, workdir=tmp / "redis") as redis_server,
    ):
        otel: dict[str, Any] = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint,
            "OTEL_TRACES_SAMPLER": "parentbased_always_on",
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s, not the default 5 s
        }
        # No worker at first: admitted jobs wait in Kafka, so the bound of 2 can be hit on purpose.
        stack = new_stack(
            kafka,
            redis_server,
            default_model_path(),
            tmp / "logs",
            workers=0,
            INFLIGHT_MAX_PENDING="2",
            **otel,
        )
        try:
            yield stack, rx
        finally:
            stack.close()


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for (n, lbls), v in samples.items() if n == name and want <= set(lbls))


def _job(url: str, **body: Any) -> httpx.Response:
    payload = {"endpoint": "/v1/completions", "body": {"model": MODEL_NAME, "prompt": "hello there", **body}}
    return httpx.post(f"{url}/v1/jobs", json=payload, timeout=30)


def test_metrics_move_as_requests_flow(traced: tuple[Stack, OTLPReceiver]) -> None:
    stack, _ = traced
    gateway_before = scrape(stack.url)
    assert total(gateway_before, "inflight:admission_rejections_total") == 0
    queued = [_job(stack.url, max_tokens=4, ignore_eos=True, temperature=0) for _ in range(2)]
    assert [r.status_code for r in queued] == [202, 202]
    assert _job(stack.url, max_tokens=4).status_code == 429
    assert total(scrape(stack.url), "inflight:admission_rejections_total", reason="capacity") == 1
    # Cancelled while still in Kafka: the worker skips it when it arrives.
    skipped = queued.pop().json()["id"]
    assert httpx.delete(f"{stack.url}/v1/jobs/{skipped}", timeout=30).json()["status"] == "cancelled"

    # Paced at 10 ms a step, the 2,000-token job below runs for at least 20 s on any host: the cancel
    # reaches it in the engine, never after it finished.
    worker = stack.add_worker(INFLIGHT_FAULT_STEP_DELAY_S="0.01")
    done = queued[0].json()["id"]
    wait_for(lambda: httpx.get(f"{stack.url}/v1/jobs/{done}", timeout=10).json()["status"] == "completed", 60)
    # Cancelled while the engine runs it.
    running = _job(stack.url, max_tokens=2000, ignore_eos=True).json()["id"]
    wait_for(
        lambda: httpx.get(f"{stack.url}/v1/jobs/{running}", timeout=10).json()["status"] == "in_progress", 30
    )
    httpx.delete(f"{stack.url}/v1/jobs/{running}", timeout=30)

    m = {"model_name": MODEL_NAME}

    def moved() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        s = scrape(worker.url)
        cancelled = total(s, "inflight:requests_cancelled_total")
        return (
            s
            if cancelled >= 2 and total(s, "inflight:request_success_total", finished_reason="abort")
            else None
        )

    s = wait_for(moved, 30, interval_s=0.3, message="the worker's counters")
    assert total(s, "inflight:requests_cancelled_total", stage="queued") == 1
    assert total(s, "inflight:requests_cancelled_total", stage="engine") == 1
    assert total(s, "inflight:request_success_total", finished_reason="length", **m) == 1
    assert total(s, "inflight:generation_tokens_total", **m) >= 4
    assert total(s, "inflight:prompt_tokens_total", **m) > 0
    assert total(s, "inflight:time_to_first_token_seconds_count", **m) == 2
    assert total(s, "inflight:e2e_request_latency_seconds_count", **m) == 2
    assert total(s, "inflight:iteration_tokens_total_count", **m) > 4
    assert total(s, "inflight:num_requests_running", **m) == 0
    assert "inflight:kafka_consumer_lag" in {name for name, _ in s}, "lag per assigned partition"
    # Measured every 2 s: it falls to 0 once the worker has fetched everything produced.
    wait_for(lambda: total(scrape(worker.url), "inflight:kafka_consumer_lag") == 0, 10, message="lag 0")


def _one(spans: list[Span], **match: Any) -> Span:
    found = [s for s in spans if all(getattr(s, k) == v for k, v in match.items())]
    assert len(found) == 1, (match, [(s.service, s.name) for s in spans])
    return found[0]


def test_one_trace_across_gateway_and_worker(traced: tuple[Stack, OTLPReceiver]) -> None:
    stack, rx = traced
    if not stack.workers:
        stack.add_worker()
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    body = {"model": MODEL_NAME, "prompt": "trace me", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    resp = httpx.post(f"{stack.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text

    def complete(spans: list[Span]) -> bool:
        # Every span asserted on below: each process exports in its own batches, and the worker's
        # consume span ends (and is exported) after the engine span it holds.
        mine = [s for s in spans if s.trace_id == CLIENT_TRACE]
        names = {s.name for s in mine}
        kinds = {s.kind for s in mine}
        return (
            any(n.startswith("engine.request") for n in names)
            and any(n.startswith("publish") for n in names)
            and {SERVER, PRODUCER, CONSUMER} <= kinds
        )

    spans = [s for s in rx.wait_for(complete) if s.trace_id == CLIENT_TRACE]
    assert {s.service for s in spans} == {"inflight-gateway", "inflight-worker"}
    server = _one(spans, kind=SERVER)
    assert server.service == "inflight-gateway" and server.name == "POST /v1/completions"
    assert server.parent_span_id == CLIENT_SPAN, "the client's traceparent is honoured"
    produce = _one(spans, kind=PRODUCER, service="inflight-gateway")
    assert produce.parent_span_id == server.span_id and produce.service == "inflight-gateway"
    consume = _one(spans, kind=CONSUMER)
    assert consume.parent_span_id == produce.span_id and consume.service == "inflight-worker"
    engine = _one(
        spans,
        service="inflight-worker",
        parent_span_id=consume.span_id,
        name="engine.request text_completion",
    )
    assert server.start_ns <= produce.start_ns <= consume.start_ns <= engine.start_ns
    # The worker ends its span after its last publish, which may be after the gateway has already
    # answered the client: the two ends are not ordered.
    assert engine.end_ns <= consume.end_ns

    names = [e.name for e in engine.events]
    assert names[:2] == ["queued", "admitted"] and names[-1] == "finished"
    assert names.index("first_token") > names.index("prefill_chunk")
    times = [e.time_ns for e in engine.events]
    assert times == sorted(times)
    a = engine.attributes
    assert a["gen_ai.request.model"] == MODEL_NAME and a["gen_ai.request.max_tokens"] == 5
    assert a["gen_ai.usage.output_tokens"] == 5 and a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.usage.input_tokens"] == resp.json()["usage"]["prompt_tokens"]
    assert 0 <= a["inflight.latency.time_to_first_token"] <= a["inflight.latency.e2e"]

    # Nobody streams this response, so its token events were held back and went out with the done
    # event and the record: one publish, under the consume span, carrying every event.
    publishes = [s for s in spans if s.name.startswith("publish")]
    (final,) = publishes
    assert final.parent_span_id == consume.span_id and final.attributes.get("inflight.final")
    assert final.attributes["messaging.batch.message_count"] >= 2  # the tokens' delta(s) and the done event

    # Streamed, the first tokens go out at once: their publish is under the engine span.
    streamed_trace = "1bf8762a27de54ee9559fc322d91420d"
    headers = {"traceparent": f"00-{streamed_trace}-{CLIENT_SPAN}-01"}
    with httpx.stream(
        "POST", f"{stack.url}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=60
    ) as streamed:
        assert streamed.status_code == 200 and "[DONE]" in streamed.read().decode()

    def published(spans: list[Span]) -> bool:
        mine = [s for s in spans if s.trace_id == streamed_trace]
        return sum(s.name.startswith("publish") for s in mine) >= 2 and any(
            s.name.startswith("engine.request") for s in mine
        )

    mine = [s for s in rx.wait_for(published) if s.trace_id == streamed_trace]
    engine = _one(mine, name="engine.request text_completion")
    assert any(p.parent_span_id == engine.span_id for p in mine if p.name.startswith("publish"))
