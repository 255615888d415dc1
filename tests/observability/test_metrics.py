"""Prometheus metrics fed by a real engine: names as exposed, and counts that match the engine's own."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.metrics import RequestRecord
from engine.sampling_params import SamplingParams
from services.common.metrics import EngineFamilies, EngineMetricsExporter, ServiceFamilies
from tests.observability.conftest import make_engine, run_to_end

# The names the issue promises, as a scraper sees them (vLLM's, with the inflight: prefix).
EXPECTED = {
    "inflight:num_requests_running",
    "inflight:num_requests_waiting",
    "inflight:kv_cache_usage_perc",
    "inflight:prefix_cache_queries_total",
    "inflight:prefix_cache_hits_total",
    "inflight:num_preemptions_total",
    "inflight:prompt_tokens_total",
    "inflight:generation_tokens_total",
    "inflight:request_success_total",
    "inflight:time_to_first_token_seconds_count",
    "inflight:time_per_output_token_seconds_count",
    "inflight:e2e_request_latency_seconds_count",
    "inflight:request_queue_time_seconds_count",
    "inflight:iteration_tokens_total_count",
    "inflight:admission_rejections_total",
    "inflight:requests_cancelled_total",
    "inflight:kafka_consumer_lag",
}


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 200) for _ in range(n)]


def test_counts_match_the_engine(tiny_path: Path, registry: CollectorRegistry) -> None:
    engine = make_engine(tiny_path)
    exporter = EngineMetricsExporter("tiny", EngineFamilies(registry))
    exporter.attach(engine)
    records: list[RequestRecord] = []
    engine.metrics.request_listeners.append(records.append)
    shared = _prompt(24, 1)  # three whole blocks of 8: the second request finds them cached
    prompts = {"a": shared + _prompt(5, 2), "b": shared + _prompt(7, 3), "c": _prompt(9, 4)}
    outputs = {"a": 4, "b": 6, "c": 3}
    engine.add_request("a", prompts["a"], SamplingParams(max_tokens=outputs["a"], ignore_eos=True))
    run_to_end(engine)
    for rid in ("b", "c"):
        engine.add_request(rid, prompts[rid], SamplingParams(max_tokens=outputs[rid], ignore_eos=True))
    s = scrape(registry)
    m = {"model_name": "tiny"}
    assert value(s, "inflight:num_requests_waiting", **m) == 2, "gauges are read when scraped"
    run_to_end(engine)

    s = scrape(registry)
    assert value(s, "inflight:prompt_tokens_total", **m) == sum(map(len, prompts.values()))
    assert value(s, "inflight:generation_tokens_total", **m) == sum(outputs.values())
    assert value(s, "inflight:request_success_total", finished_reason="length", **m) == 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert value(s, f"inflight:{name}_count", **m) == 3
    # TPOT needs two tokens after the first: every request here has them.
    assert value(s, "inflight:time_per_output_token_seconds_count", **m) == 3
    assert value(s, "inflight:e2e_request_latency_seconds_sum", **m) == pytest.approx(
        sum(r.finished - r.arrival for r in records if r.finished is not None)
    )
    steps = list(engine.metrics.steps)
    assert value(s, "inflight:iteration_tokens_total_count", **m) == len(steps)
    assert value(s, "inflight:iteration_tokens_total_sum", **m) == sum(
        r.stats.num_scheduled_tokens for r in steps
    )
    last = steps[-1].stats
    assert value(s, "inflight:prefix_cache_queries_total", **m) == last.prefix_cache_queries > 0
    assert value(s, "inflight:prefix_cache_hits_total", **m) == last.prefix_cache_hits >= 24
    assert value(s, "inflight:num_requests_running", **m) == 0, "an idle engine reads zero, not its last step"
    assert value(s, "inflight:kv_cache_usage_perc", **m) == engine.kv.usage

    exporter.detach(engine)
    engine.add_request("d", _prompt(5, 5), SamplingParams(max_tokens=2, ignore_eos=True))
    run_to_end(engine)
    assert value(scrape(registry), "inflight:prompt_tokens_total", **m) == sum(map(len, prompts.values()))


def test_preemptions_and_cancellations_are_counted(tiny_path: Path, registry: CollectorRegistry) -> None:
    engine = make_engine(tiny_path, num_blocks=10, block_size=4, max_num_seqs=3, enable_prefix_caching=False)
    engine.add_request("warm", _prompt(4, 9), SamplingParams(max_tokens=1))
    run_to_end(engine)  # steps before attaching are not counted again
    EngineMetricsExporter("tiny", EngineFamilies(registry)).attach(engine)
    for i in range(3):
        engine.add_request(f"p{i}", _prompt(12, 10 + i), SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("x", _prompt(6, 20), SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    engine.abort_request("x")
    run_to_end(engine)
    s = scrape(registry)
    assert engine.scheduler.num_preemptions > 0
    assert value(s, "inflight:num_preemptions_total", model_name="tiny") == engine.scheduler.num_preemptions
    assert value(s, "inflight:request_success_total", model_name="tiny", finished_reason="abort") == 1
    assert value(s, "inflight:request_success_total", model_name="tiny", finished_reason="length") == 3


def test_exposition_has_every_promised_name(registry: CollectorRegistry) -> None:
    EngineMetricsExporter("m", EngineFamilies(registry))
    service = ServiceFamilies(registry)
    service.admission_rejections.labels("capacity").inc()
    service.requests_cancelled.labels("engine").inc()
    service.set_consumer_lag({("topic", 0): 3})
    names = {name for name, _ in scrape(registry)}
    assert EXPECTED - names == set()


def test_consumer_lag_follows_the_assignment(registry: CollectorRegistry) -> None:
    service = ServiceFamilies(registry)
    service.set_consumer_lag({("t", 0): 5, ("t", 1): 2})
    service.set_consumer_lag({("t", 1): 0, ("t", 2): -1})  # partition 0 revoked; negative lag is 0
    s = scrape(registry)
    lags = {
        dict(labels)["partition"]: v
        for (name, labels), v in s.items()
        if name == "inflight:kafka_consumer_lag"
    }
    assert lags == {"1": 0.0, "2": 0.0}
