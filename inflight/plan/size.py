"""The smallest fleet meeting an SLO at P99: workers searched, partitions and admission bound derived.

For a worker count N the fleet is N workers with one partition each (fewer partitions than workers
leaves workers idle; more only helps a later scale-up) and a gateway bound of
ceil(rate * TTFT SLO) pending requests: by Little's law that is as many as can still start within the
TTFT budget, and a request queued behind more would miss it anyway, so it is better told 429 at once.
N meets the SLO when P99 TTFT and P99 TPOT are within it and the gateway turns away at most 1%.
Latency falls as N grows, so the search doubles N until it passes, then bisects.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.cost_model import StepCostModel
from inflight.plan.simulate import FleetConfig, ServicePath, SimRequest, simulate

MAX_REJECTED = 0.01


@dataclass(frozen=True)
class Target:
    ttft_s: float
    tpot_s: float


def fleet_for(
    workers: int,
    rate: float,
    target: Target,
    sample: int | None,
    engine: dict[str, Any],
    max_waiting: int,
    service: ServicePath | None = None,
    shape_cache: int | None = None,
) -> FleetConfig:
    return FleetConfig(
        workers=workers,
        partitions=workers,
        max_pending=max(1, math.ceil(rate * target.ttft_s)),
        max_waiting=max_waiting,
        engine=engine,
        sample_workers=sample if sample is not None and sample < workers else None,
        service=service or ServicePath(),
        cold_shapes=shape_cache is not None,
        shape_cache=shape_cache,
    )


def meets(result: dict[str, Any], target: Target) -> bool:
    rejected = result["num_rejected_gateway"] + result["num_rejected_slo"]
    return (
        result["ttft_p99_s"] <= target.ttft_s
        and result["tpot_p99_s"] <= target.tpot_s
        and rejected <= MAX_REJECTED * max(1, result["num_requests"])
    )


def search(
    workload: Callable[[FleetConfig], list[SimRequest]],
    cost: StepCostModel,
    rate: float,
    target: Target,
    *,
    sample: int | None = None,
    engine: dict[str, Any] | None = None,
    max_workers: int = 4096,
    max_waiting: int = 16,
    service: ServicePath | None = None,
    shape_cache: int | None = None,
) -> tuple[int | None, list[dict[str, Any]]]:
    """(smallest passing worker count or None, every simulated point in worker order)."""
    tried: dict[int, dict[str, Any]] = {}

    def check(n: int) -> bool:
        fleet = fleet_for(n, rate, target, sample, engine or {}, max_waiting, service, shape_cache)
        tried[n] = simulate(workload(fleet), cost, fleet)
        tried[n]["meets_slo"] = meets(tried[n], target)
        return bool(tried[n]["meets_slo"])

    hi = 1
    while not check(hi):
        if hi >= max_workers:
            return None, [tried[k] for k in sorted(tried)]
        hi = min(max_workers, hi * 2)
    lo = hi // 2  # fails (or 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check(mid):
            hi = mid
        else:
            lo = mid
    return hi, [tried[k] for k in sorted(tried)]


def table(points: list[dict[str, Any]]) -> str:
    rows = [
        f"{'workers':>7} {'parts':>5} {'bound':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
        f"{'TPOT p99':>9} {'out tok/s':>10} {'429s':>6}  meets"
    ]
    for p in points:
        rows.append(
            f"{p['workers']:>7} {p['partitions']:>5} {p['max_pending']:>6} {_ms(p['ttft_p50_s'])} "
            f"{_ms(p['ttft_p99_s'])} {_ms(p['tpot_p50_s'])} {_ms(p['tpot_p99_s'])} "
            f"{p['output_tok_s']:>10.1f} {p['num_rejected_gateway']:>6}  {'yes' if p['meets_slo'] else 'no'}"
        )
    return "\n".join(rows)


def _ms(seconds: float) -> str:
    return f"{'-':>9}" if not math.isfinite(seconds) else f"{seconds * 1e3:>7.0f}ms"


def plot(points: list[dict[str, Any]], target: Target, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p["workers"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, bound, name in (
        (axes[0], "ttft_p99_s", target.ttft_s, "TTFT"),
        (axes[1], "tpot_p99_s", target.tpot_s, "TPOT"),
    ):
        ax.plot(xs, [1e3 * p[key] for p in points], marker="o", label=f"P99 {name} (simulated)")
        ax.axhline(1e3 * bound, color="red", linestyle="--", label=f"SLO {bound * 1e3:g} ms")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("workers")
        ax.set_ylabel("ms")
        ax.set_title(f"P99 {name} vs workers")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
