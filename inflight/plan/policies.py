"""fcfs vs priority vs slo on bursty arrivals, simulated with the engine's own scheduler.

Capacity is measured first, in the same simulation: every request of the mix at t = 0, completed
requests per second over the makespan. Then, for each arrival CV and load (a fraction of capacity),
the same requests run under each policy; goodput counts the requests meeting both SLO bounds.
The mix is the benchmark's (short questions, a quarter long documents); for the priority policy the
questions are urgent (0) and the documents not (1), the one labelling a priority user would choose.
``slo+reject`` is the slo policy finishing lost requests early.

The real engine runs the same comparison, measured, from a source checkout: ``python -m bench policies``
(bench/policy_bench.py, ``make bench-policies``).
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.cost_model import StepCostModel
from inflight.plan.simulate import FleetConfig, SimRequest, simulate
from inflight.plan.traffic import synthetic

POLICIES = ("fcfs", "priority", "slo", "slo+reject")
SHORT_PROMPT_MAX = 128  # the benchmark mix's questions are 16-128 tokens, documents 256-512


def _engine(policy: str, slo: tuple[float, float], base: dict[str, Any]) -> dict[str, Any]:
    eng = {**base, "scheduling_policy": policy.split("+")[0]}
    if policy.startswith("slo"):
        eng.update(slo_ttft_s=slo[0], slo_tpot_s=slo[1], slo_reject=policy.endswith("+reject"))
    return eng


def capacity(cost: StepCostModel, num_requests: int, base: dict[str, Any], seed: int) -> float:
    burst = [
        SimRequest(0.0, r.prompt_len, r.output_len, 0) for r in synthetic(1e3, num_requests / 1e3, seed=seed)
    ]
    result = simulate(burst, cost, FleetConfig(workers=1, max_waiting=None, engine=base))
    return float(result["num_completed"] / result["duration_s"])


def compare(
    cost: StepCostModel,
    slo: tuple[float, float],
    *,
    cvs: tuple[float, ...] = (2.0, 4.0),
    loads: tuple[float, ...] = (0.8, 1.0, 1.2),
    num_requests: int = 1500,
    engine: dict[str, Any] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    base = dict(engine or {})
    cap = capacity(cost, num_requests, base, seed)
    rows = []
    for cv in cvs:
        for load in loads:
            rate = load * cap
            reqs = [
                SimRequest(r.arrival, r.prompt_len, r.output_len, 0, int(r.prompt_len > SHORT_PROMPT_MAX))
                for r in synthetic(rate, num_requests / rate, process="gamma", cv=cv, seed=seed)
            ]
            for policy in POLICIES:
                fleet = FleetConfig(workers=1, max_waiting=None, engine=_engine(policy, slo, base))
                r = simulate(reqs, cost, fleet, slo)
                rows.append(
                    {
                        "cv": cv,
                        "load": load,
                        "rate": rate,
                        "policy": policy,
                        "goodput_req_s": r["goodput_req_s"],
                        "ttft_p99_s": r["ttft_p99_s"],
                        "tpot_p99_s": r["tpot_p99_s"],
                        "output_tok_s": r["output_tok_s"],
                        "num_rejected_slo": r["num_rejected_slo"],
                        "num_requests": r["num_requests"],
                        "num_good": r["num_good"],
                    }
                )
    return {"capacity_req_s": cap, "slo": {"ttft_s": slo[0], "tpot_s": slo[1]}, "rows": rows}


def _pairs(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any], float]]:
    """Each row with the fcfs row of its cell and repeat, and its goodput over that one's."""
    fcfs = {(r["cv"], r["load"], r.get("repeat", 0)): r for r in rows if r["policy"] == "fcfs"}
    out = []
    for r in rows:
        base = fcfs[(r["cv"], r["load"], r.get("repeat", 0))]
        good = base["goodput_req_s"]
        out.append((r, base, r["goodput_req_s"] / good if good > 0 else float("inf")))
    return out


def ceiling(base: dict[str, Any]) -> float:
    """The most a policy can meet over what fcfs met on the arrivals of ``base`` (fcfs's row): its
    requests over those fcfs met, reached by meeting every one. Where fcfs meets 80%, no policy
    gets past 1.25x, whatever the target (the goodput ratio is this count ratio up to the runs'
    spans, which the last arrival sets unless the queue drains long after). NaN for rows from
    before the counts were kept."""
    total, good = base.get("num_requests"), base.get("num_good")
    if total is None or good is None:
        return float("nan")
    return total / good if good > 0 else float("inf")


# What a pairing collects from each pair, given fcfs's row and the pair's goodput ratio.
PairValue = Callable[[dict[str, Any], float], float]


def _ratio(base: dict[str, Any], ratio: float) -> float:
    return ratio


def pair_ceiling(base: dict[str, Any], ratio: float) -> float:
    """The pair's ceiling (see ceiling), as a PairValue."""
    return ceiling(base)


def paired_ratios(
    rows: list[dict[str, Any]], value: PairValue = _ratio
) -> dict[tuple[float, float, str], list[float]]:
    """Each policy's goodput over fcfs's in the same cell and repeat, by (cv, load, policy).
    ``value`` picks what is collected instead of the ratio, e.g. pair_ceiling."""
    ratios: dict[tuple[float, float, str], list[float]] = {}
    for r, base, ratio in _pairs(rows):
        ratios.setdefault((r["cv"], r["load"], r["policy"]), []).append(value(base, ratio))
    return ratios


def by_met_load(
    rows: list[dict[str, Any]],
    edges: tuple[float, ...] = (0.9, 1.1),
    value: PairValue = _ratio,
) -> dict[tuple[float, str, str], list[float]]:
    """Paired ratios regrouped by the load the pair met (the mean of its two runs' effective_load,
    measured runs only), in bins split at ``edges``: by (cv, bin label, policy). ``value``: as in
    paired_ratios."""
    inner = [f"{a:g}-{b:g}" for a, b in itertools.pairwise(edges)]
    labels = [f"<{edges[0]:g}", *inner, f">={edges[-1]:g}"]
    out: dict[tuple[float, str, str], list[float]] = {}
    for r, base, ratio in _pairs(rows):
        met = (base.get("effective_load"), r.get("effective_load"))
        if r["policy"] == "fcfs" or met[0] is None or met[1] is None:
            continue
        load = (met[0] + met[1]) / 2
        label = labels[sum(load >= e for e in edges)]
        out.setdefault((r["cv"], label, r["policy"]), []).append(value(base, ratio))
    return dict(sorted(out.items(), key=lambda kv: (kv[0][0], labels.index(kv[0][1]), kv[0][2])))


def _capacity_source(result: dict[str, Any]) -> str:
    if result.get("capacity_pinned"):
        return "pinned: an earlier run's measured burst"
    return f"{result.get('source', 'simulated')} burst"


def table(result: dict[str, Any]) -> str:
    measured = any("effective_load" in r for r in result["rows"])
    lines = [
        f"capacity {result['capacity_req_s']:.3f} req/s ({_capacity_source(result)}), SLO "
        f"TTFT {result['slo']['ttft_s'] * 1e3:.0f} ms, TPOT {result['slo']['tpot_s'] * 1e3:.0f} ms",
        f"{'cv':>4} {'load':>5}" + (f" {'met':>5}" if measured else "") + f" {'policy':<11} {'goodput':>8} "
        f"{'x fcfs':>7} {'ceiling':>7} {'TTFT p99':>9} {'TPOT p99':>9} {'dropped':>7}",
    ]
    for r, base, ratio in _pairs(result["rows"]):
        met = f" {r['effective_load']:>5.2f}" if measured else ""
        lines.append(
            f"{r['cv']:>4g} {r['load']:>5g}{met} {r['policy']:<11} {r['goodput_req_s']:>8.3f} {ratio:>6.2f}x "
            f"{ceiling(base):>6.2f}x {r['ttft_p99_s']:>8.2f}s {1e3 * r['tpot_p99_s']:>7.0f}ms "
            f"{r['num_rejected_slo']:>7}"
        )
    lines.append("ceiling: the most any policy's goodput can be over fcfs's there (every request met)")
    if result.get("repeats", 1) > 1:
        lines.append("goodput over fcfs's in the same repeat: median [lowest, highest], median ceiling")
        ceilings = paired_ratios(result["rows"], pair_ceiling)
        for key, xs in paired_ratios(result["rows"]).items():
            cv, load, policy = key
            if policy != "fcfs":
                mid, top = statistics.median(xs), statistics.median(ceilings[key])
                lines.append(
                    f"{cv:>4g} {load:>5g} {policy:<11} {mid:>6.2f}x [{min(xs):.2f}, {max(xs):.2f}], "
                    f"ceiling {top:.2f}x"
                )
    if measured:
        lines.append("met: the load a run met, its label times its host level over the capacity burst's")
        lines.append(
            "goodput over fcfs's, pairs by the load they met: median [lowest, highest] (pairs), median "
            "ceiling"
        )
        tops = by_met_load(result["rows"], value=pair_ceiling)
        for bin_key, xs in by_met_load(result["rows"]).items():
            cv, label, policy = bin_key
            mid = statistics.median(xs)
            lines.append(
                f"{cv:>4g} {label:>7} {policy:<11} {mid:>6.2f}x [{min(xs):.2f}, {max(xs):.2f}] ({len(xs)}), "
                f"ceiling {statistics.median(tops[bin_key]):.2f}x"
            )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    cvs = sorted({r["cv"] for r in rows})
    fig, axes = plt.subplots(len(cvs), 3, figsize=(14, 3.6 * len(cvs)), squeeze=False)
    for i, cv in enumerate(cvs):
        for j, (key, label, scale) in enumerate(
            (
                ("goodput_req_s", "goodput (req/s)", 1.0),
                ("ttft_p99_s", "P99 TTFT (s)", 1.0),
                ("tpot_p99_s", "P99 TPOT (ms)", 1e3),
            )
        ):
            ax = axes[i][j]
            for policy in POLICIES:
                by_load: dict[float, list[float]] = {}
                for r in rows:
                    if r["cv"] == cv and r["policy"] == policy:
                        by_load.setdefault(r["load"], []).append(scale * r[key])
                if not by_load:
                    continue
                loads = sorted(by_load)  # the median of a cell's repeats
                ax.plot(loads, [statistics.median(by_load[x]) for x in loads], marker="o", label=policy)
            ax.set_xlabel("load (x capacity)")
            ax.set_title(f"{label}, gamma CV {cv:g}")
            if key != "goodput_req_s":
                ax.set_yscale("log")
            ax.legend(fontsize=8)
    slo, source = result["slo"], result.get("source", "simulated")
    fig.suptitle(f"{source}: SLO TTFT {slo['ttft_s'] * 1e3:.0f} ms, TPOT {slo['tpot_s'] * 1e3:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
