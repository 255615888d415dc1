"""What observability costs the engine: the same workload with no listeners, with the Prometheus exporter
and a no-op tracer (tracing switched off, as deployed without a collector), and with tracing on.

    python -m bench.tracing_overhead [--model tiny|bench] [--rounds 24] [--out FILE.json]

Two measurements, both on one engine in one process:

1. End to end: rounds of the whole workload, the modes interleaved (bare, bare again, off, on, ...) so
   a slow moment of a shared machine hits every mode alike. Every round runs the same steps, so the
   figure is, per mode, the sum over steps of the median over rounds of that step's time (wall, and
   the engine thread's CPU time), against bare. "bare again" is the A/A control: its difference from
   bare is the host's noise floor, below which these figures say nothing.
2. Listener time: the step and request records of one run replayed through each mode's listeners,
   timed alone. On a noisy host this isolates the cost end-to-end ratios can only bound; the share is
   that time over the bare run's CPU time.

Prefix caching is off and every request ignores EOS, so each round does exactly the same steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from prometheus_client import CollectorRegistry

from engine.llm_engine import LLMEngine
from engine.metrics import RequestRecord, StepRecord
from engine.sampling_params import SamplingParams
from services.common.engine_spans import EngineSpanExporter
from services.common.metrics import EngineFamilies, EngineMetricsExporter

# "bare again" is a second run of bare: the A/A control. Its difference from bare is what this host's
# noise alone produces, the floor below which the end-to-end figures mean nothing.
MODES = ("bare", "bare again", "off", "on")
COMPARED = ("bare again", "off", "on")


class _Discard(SpanExporter):
    """Exports nowhere: the SDK's whole pipeline runs (span, processor queue, export thread), no I/O."""

    def __init__(self) -> None:
        self.num_spans = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.num_spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


@dataclass
class Mode:
    name: str
    attach: Callable[[LLMEngine], None]
    detach: Callable[[LLMEngine], None]
    on_step: list[Callable[[StepRecord], None]]
    on_request: list[Callable[[RequestRecord], None]]


def make_modes(provider: TracerProvider, step_sample_every: int) -> dict[str, Mode]:
    modes = {name: Mode(name, lambda e: None, lambda e: None, [], []) for name in ("bare", "bare again")}
    for name, tracer in (("off", trace.NoOpTracer()), ("on", provider.get_tracer("bench"))):
        # Own registries: the modes must not share label children.
        metrics = EngineMetricsExporter("bench", EngineFamilies(CollectorRegistry()))
        spans = EngineSpanExporter(
            tracer, "bench", step_sample_every=step_sample_every if name == "on" else 0
        )

        def attach(e: LLMEngine, m: EngineMetricsExporter = metrics, s: EngineSpanExporter = spans) -> None:
            m.attach(e)
            s.attach(e)

        def detach(e: LLMEngine, m: EngineMetricsExporter = metrics, s: EngineSpanExporter = spans) -> None:
            m.detach(e)
            s.detach(e)

        step_fns: list[Callable[[StepRecord], None]] = [metrics.on_step]
        if spans.step_sample_every:
            step_fns.append(spans.on_step)
        modes[name] = Mode(name, attach, detach, step_fns, [metrics.on_request, spans.on_request])
    return modes


def workload(num_requests: int, vocab: int, seed: int) -> list[tuple[str, list[int], int]]:
    rng = random.Random(seed)
    return [
        (f"r{i}", [rng.randrange(4, vocab) for _ in range(rng.randint(16, 96))], rng.randint(16, 64))
        for i in range(num_requests)
    ]


def run_round(
    engine: LLMEngine, specs: list[tuple[str, list[int], int]], tag: str
) -> tuple[list[float], list[float]]:
    """Per-step wall seconds and engine-thread CPU seconds of the whole workload (listeners run inside
    ``step()``, so their cost is in both)."""
    for rid, prompt, max_tokens in specs:
        engine.add_request(f"{tag}-{rid}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    walls, cpus = [], []
    while engine.has_unfinished_requests():
        wall, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    return walls, cpus


def robust_total(rounds: list[list[float]]) -> float:
    """Sum over step k of the median over rounds of step k's time. Every round runs the same steps, so
    a burst from another tenant of the host disturbs a few (round, step) cells and no median."""
    return sum(statistics.median(column) for column in zip(*rounds, strict=True))


def listener_seconds(
    mode: Mode, steps: list[StepRecord], requests: list[RequestRecord], repeat: int
) -> float:
    """Seconds one run's records spend in ``mode``'s listeners (best of ``repeat`` replays)."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for record in steps:
            for on_step in mode.on_step:
                on_step(record)
        for req in requests:
            for on_request in mode.on_request:
                on_request(req)
        best = min(best, time.perf_counter() - start)
    return best


def measure(
    model: str, rounds: int, num_requests: int, step_sample_every: int, threads: int
) -> dict[str, Any]:
    torch.set_num_threads(threads)
    if model == "bench":
        from inflight.plan.workload import bench_model_path

        path = bench_model_path()
    else:
        from engine.models.tiny import default_model_path

        path = default_model_path()
    engine = LLMEngine.from_engine_args(str(path), max_num_seqs=16, enable_prefix_caching=False)
    specs = workload(num_requests, min(engine.config.model.vocab_size, 1000), seed=0)
    discard = _Discard()
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(discard))
    modes = make_modes(provider, step_sample_every)

    # Warm-up round, recording what the engine reports, for the listener replay below.
    steps: list[StepRecord] = []
    requests: list[RequestRecord] = []
    engine.metrics.step_listeners.append(steps.append)
    engine.metrics.request_listeners.append(requests.append)
    run_round(engine, specs, "warm")
    engine.metrics.step_listeners.clear()
    engine.metrics.request_listeners.clear()

    walls: dict[str, list[list[float]]] = {m: [] for m in MODES}
    cpus: dict[str, list[list[float]]] = {m: [] for m in MODES}
    shuffle = random.Random(1)
    for i in range(rounds):
        # A fresh order each round: no mode always follows the same one (and inherits its leftovers).
        order = list(MODES)
        shuffle.shuffle(order)
        for name in order:
            mode = modes[name]
            mode.attach(engine)
            wall, cpu = run_round(engine, specs, f"{name}{i}")
            mode.detach(engine)
            walls[name].append(wall)
            cpus[name].append(cpu)
            # Leftovers settle between rounds, untimed: spans still queued for export, garbage.
            provider.force_flush()
            gc.collect()
    # Replayed while the provider still exports: the "on" listeners pay the whole span pipeline.
    listener = {m: listener_seconds(modes[m], steps, requests, repeat=5) for m in ("off", "on")}
    provider.shutdown()

    wall_total = {m: robust_total(t) for m, t in walls.items()}
    cpu_total = {m: robust_total(t) for m, t in cpus.items()}
    num_steps = len(walls["bare"][0])
    return {
        "model": model,
        "threads": threads,
        "rounds": rounds,
        "num_requests": num_requests,
        "steps_per_round": num_steps,
        "step_sample_every": step_sample_every,
        "round_wall_s": {m: [sum(r) for r in t] for m, t in walls.items()},
        "robust_wall_s": wall_total,
        "robust_cpu_s": cpu_total,
        "step_ms_bare": 1e3 * wall_total["bare"] / max(1, num_steps),
        "overhead_pct_wall": {m: 100 * (wall_total[m] / wall_total["bare"] - 1) for m in COMPARED},
        "overhead_pct_cpu": {m: 100 * (cpu_total[m] / cpu_total["bare"] - 1) for m in COMPARED},
        "listener_us_per_step": {m: 1e6 * listener[m] / max(1, len(steps)) for m in listener},
        "overhead_pct_listeners": {m: 100 * listener[m] / cpu_total["bare"] for m in listener},
        "spans_exported": discard.num_spans,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", choices=("tiny", "bench"), default="tiny")
    p.add_argument("--rounds", type=int, default=24)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--step-sample-every", type=int, default=16, help="step spans in mode 'on' (0: none)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench-results/tracing_overhead.json"))
    args = p.parse_args(argv)
    result = measure(args.model, args.rounds, args.requests, args.step_sample_every, args.threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    wall, cpu, share = (
        result[k] for k in ("overhead_pct_wall", "overhead_pct_cpu", "overhead_pct_listeners")
    )
    us = result["listener_us_per_step"]
    print(f"{result['model']}: {result['steps_per_round']} steps/round, {result['step_ms_bare']:.2f} ms/step")
    print(f"end to end against bare (per-step medians of {args.rounds} rounds): engine-thread CPU / wall")
    for m in COMPARED:
        line = f"  {m:<11} {cpu[m]:+6.2f}% / {wall[m]:+6.2f}%"
        if m in us:
            line += f"   listeners alone: {share[m]:.3f}% ({us[m]:.1f} us/step)"
        else:
            line += "   (A/A control: the host's noise floor)"
        print(line)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
