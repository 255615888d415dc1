"""Predicted vs measured: one in-process engine replays a trace in real time, the simulator replays
the same trace with the cost model, and the two summaries are compared figure by figure."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from engine.cost_model import StepCostModel, StepSample
from inflight.plan.simulate import FleetConfig, simulate
from inflight.plan.traffic import from_specs

FIGURES = ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "output_tok_s")


def _pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    values = sorted(values)
    k = (len(values) - 1) * q / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def measure(
    model: str, specs: Sequence[Any], engine_args: dict[str, Any]
) -> tuple[dict[str, float], list[StepSample]]:
    """Replay ``specs`` against one in-process engine, open loop, as the benchmark's driver does
    (requests join at the first step boundary after their arrival), recording only token times: a
    step listener would add its own cost to every step, which the calibration did not see.

    Also returns the run's own steps as cost samples (the engine keeps its last step records), so a
    model fitted on them separates the simulator's fidelity from the host's drift since calibration."""
    import time

    from bench.session import warmup_specs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    engine = LLMEngine.from_engine_args(model, **engine_args)
    for i, s in enumerate(warmup_specs(engine.config.model.vocab_size, engine.config.max_model_len)):
        engine.add_request(
            f"warm-{i}", list(s.prompt_token_ids), SamplingParams(max_tokens=4, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()
    specs = sorted(specs, key=lambda s: s.arrival)
    times: dict[str, list[float]] = {s.request_id: [] for s in specs}
    samples: list[StepSample] = []
    t0 = time.monotonic()
    i = 0
    while i < len(specs) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while i < len(specs) and specs[i].arrival <= now:
            s = specs[i]
            params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(s.request_id, list(s.prompt_token_ids), params, arrival_time=t0 + s.arrival)
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, specs[i].arrival - now))
            continue
        before = engine.metrics.num_steps
        started = time.perf_counter()
        outputs = engine.step()
        if engine.metrics.num_steps > before:
            batch = engine.metrics.steps[-1].batch
            samples.append(
                StepSample(
                    sum(n for _, n, _ in batch),
                    len(batch),
                    sum(n + done for _, n, done in batch),
                    time.perf_counter() - started,
                )
            )
        t = time.monotonic() - t0
        for out in outputs:
            times[out.request_id].extend([t] * sum(len(c.token_ids) for c in out.outputs))
    arrival = {s.request_id: s.arrival for s in specs}
    ttft = [ts[0] - arrival[rid] for rid, ts in times.items() if ts]
    tpot = [(ts[-1] - ts[0]) / (len(ts) - 1) for ts in times.values() if len(ts) > 1]
    end = max(max((ts[-1] for ts in times.values() if ts), default=0.0), specs[-1].arrival if specs else 0.0)
    figures = {
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p99_s": _pct(ttft, 99),
        "tpot_p50_s": _pct(tpot, 50),
        "tpot_p99_s": _pct(tpot, 99),
        "output_tok_s": sum(len(ts) for ts in times.values()) / end,
    }
    return figures, samples


def predict(specs: Sequence[Any], cost: StepCostModel, engine_args: dict[str, Any]) -> dict[str, float]:
    """The same trace through the simulator: one worker, nothing between the driver and the engine."""
    fleet = FleetConfig(workers=1, max_waiting=None, engine=engine_args)
    result = simulate(from_specs(specs), cost, fleet)
    return {k: float(result[k]) for k in FIGURES}


def compare(measured: dict[str, float], predicted: dict[str, float]) -> dict[str, float]:
    """Relative error of each prediction: (predicted - measured) / measured."""
    return {k: (predicted[k] - measured[k]) / measured[k] for k in FIGURES}
