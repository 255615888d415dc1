"""The engine benchmark's targets, each next to the figure measured for it, met or not."""

from __future__ import annotations

import math
from typing import Any

from bench.micro import DecodeProbeResult, run_decode_share
from bench.results import RunResult
from engine.config import ModelConfig


def _ratio(a: float | None, b: float | None) -> float:
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b):
        return math.nan
    if b == 0:
        return math.inf if a > 0 else math.nan
    return a / b


def _figure(
    name: str, value: float, op: str, bound: float, detail: str, note: str = "", decided: bool = True
) -> dict[str, Any]:
    if math.isnan(value) or not decided:
        met = None  # not measurable in this run (a target missing, no sample, or only a bound)
    else:
        met = value <= bound if op == "<=" else value < bound if op == "<" else value >= bound
    return {
        "figure": name,
        "value": value,
        "target": f"{op} {bound:g}",
        "met": met,
        "detail": detail,
        "note": note,
    }


def full_batch_share(run: RunResult | None, batch: int) -> tuple[float, int]:
    """(schedule + input preparation) / step time over the run's steps with ``batch`` sequences."""
    if run is None:
        return math.nan, 0
    steps = [s for s in run.steps if s.num_scheduled_seqs == batch]
    total = sum(s.duration for s in steps)
    if not total:
        return math.nan, 0
    return sum(s.schedule_time + s.prepare_time for s in steps) / total, len(steps)


def target_figures(
    probe: DecodeProbeResult,
    saturation: dict[str, dict[str, Any]],
    near: dict[str, dict[str, Any]],
    max_rates: dict[str, tuple[float, bool]],
    continuous_saturation: RunResult | None,
    *,
    lowest_rate: float,
    model: ModelConfig,
    max_num_seqs: int,
) -> list[dict[str, Any]]:
    figs = []
    c_near, s_near = near.get("continuous"), near.get("static")
    c_p99 = c_near["ttft"]["p99_ms"] if c_near else None
    s_p99 = s_near["ttft"]["p99_ms"] if s_near else None
    rate = c_near["offered_rate"] if c_near else math.nan
    figs.append(
        _figure(
            "P99 TTFT continuous / static, Poisson near static's saturation",
            _ratio(c_p99, s_p99),
            "<=",
            0.2,
            f"at {rate:.3f} req/s: continuous {c_p99 or math.nan:.0f} ms, static {s_p99 or math.nan:.0f} ms",
        )
    )
    (c_max, c_bounded), (s_max, s_bounded) = (
        max_rates.get("continuous", (0, True)),
        max_rates.get("static", (0, True)),
    )
    ratio = _ratio(c_max, s_max)
    # A rate that passed everywhere is only a lower bound: the ratio is decided when the bound
    # sits on the right side (continuous unbounded and already >= 2x) or both are bounded.
    decided = s_bounded and (c_bounded or ratio >= 2.0)
    note = ""
    if not c_bounded or not s_bounded:
        unbounded = [n for n, b in (("continuous", c_bounded), ("static", s_bounded)) if not b]
        note = f"{' and '.join(unbounded)} passed every rate tried: a lower bound; sweep higher rates"
    if s_max == 0 and lowest_rate > 0:
        # Static failed even the lowest rate: its limit is below it, so the ratio exceeds this.
        ratio = c_max / lowest_rate
        decided = c_max > 0 and ratio >= 2.0
        note = f"static failed at the lowest rate tried ({lowest_rate:.3f} req/s): the ratio is a lower bound"
    figs.append(
        _figure(
            "max request rate at P99 TTFT <= 2 s, continuous / static",
            ratio,
            ">=",
            2.0,
            f"continuous {'>= ' if not c_bounded else ''}{c_max:.3f} req/s, static "
            f"{'>= ' if not s_bounded else ''}{s_max:.3f} req/s",
            note,
            decided,
        )
    )
    # Judged over the saturated window (see stats.backlog_throughput); the whole-run and per-CPU-second
    # ratios are printed with it.
    c_sat = saturation.get("continuous", {}).get("saturated_output_throughput")
    c_tok = saturation.get("continuous", {}).get("output_throughput")
    c_cpu = saturation.get("continuous", {}).get("output_tokens_per_cpu_s")
    peers: tuple[tuple[str, float], ...] = (("static", 1.5), ("hf-batch", 3.0), ("hf-generate", 2.0))
    if "vllm" in saturation:  # target: at least vLLM's CPU backend at the same dtype and threads
        peers += (("vllm", 1.0),)
    for peer, bound in peers:
        p_sat = saturation.get(peer, {}).get("saturated_output_throughput")
        p_tok = saturation.get(peer, {}).get("output_throughput")
        p_cpu = saturation.get(peer, {}).get("output_tokens_per_cpu_s")
        figs.append(
            _figure(
                f"saturation output tokens/s, continuous / {peer}",
                _ratio(c_sat, p_sat),
                ">=",
                bound,
                f"saturated window: continuous {c_sat or math.nan:.1f}, {peer} "
                f"{p_sat or math.nan:.1f} tokens/s; "
                f"whole run incl. drain {c_tok or math.nan:.1f} vs {p_tok or math.nan:.1f} "
                f"(ratio {_ratio(c_tok, p_tok):.2f}); per CPU-second {c_cpu or math.nan:.1f} vs "
                f"{p_cpu or math.nan:.1f} (ratio {_ratio(c_cpu, p_cpu):.2f})",
            )
        )
    share_in_run, num_steps = math.nan, 0
    if continuous_saturation is not None:
        share_in_run, num_steps = run_decode_share(
            continuous_saturation, model, probe.batch, probe.packed_matmul_gflops
        )
    run_share = (
        f"saturation run, {num_steps} decode-only steps at {probe.batch}: {share_in_run:.2f}"
        if num_steps
        else f"the saturation run had no decode-only step at {probe.batch}"
    )
    figs.append(
        _figure(
            f"decode step at {probe.batch} running: useful FLOP/s / its linear layers' rate",
            probe.step_share_of_packed_rate,
            ">=",
            0.5,
            f"{probe.step_gflop:.2f} GFLOP in {probe.step_ms:.0f} ms = {probe.step_gflops:.1f} GFLOP/s; "
            f"the model's own linears at {probe.linear_rows} rows {probe.packed_matmul_gflops:.1f} GFLOP/s "
            f"(raw F.linear {probe.raw_matmul_gflops:.1f}); mean context {probe.context_mean:.0f}; "
            f"model time only: {probe.model_share_of_packed_rate:.2f}; {run_share}",
        )
    )
    eng = saturation.get("continuous", {}).get("engine", {})
    figs.append(
        _figure(
            "KV slots allocated but empty / used KV (continuous, saturation run)",
            eng.get("kv_empty_slot_share", math.nan),
            "<",
            0.05,
            f"summed over {eng.get('num_steps', 0)} steps; decode probe: {probe.kv_empty_slot_share:.3f}",
        )
    )
    share, n = full_batch_share(continuous_saturation, max_num_seqs)
    figs.append(
        _figure(
            f"scheduler + input preparation / step time at {probe.batch} running",
            probe.sched_prep_share,
            "<",
            0.10,
            f"decode probe: schedule {probe.schedule_ms:.2f} ms + prepare {probe.prepare_ms:.2f} ms of "
            f"{probe.step_ms:.0f} ms; saturation run, {n} steps at {max_num_seqs} seqs: {share:.3f}",
        )
    )
    return figs


def print_figures(figs: list[dict[str, Any]]) -> None:
    print("\ntargets")
    for f in figs:
        met = {True: "MET", False: "NOT MET", None: "n/a"}[f["met"]]
        print(f"  [{met:>7}] {f['figure']}: {f['value']:.3f} (target {f['target']})")
        print(f"            {f['detail']}")
        if f["note"]:
            print(f"            note: {f['note']}")
