"""Simulated traffic: a benchmark trace as lengths and keys, or the benchmark's synthetic workload
generated for the sampled share of a fleet only."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from inflight.plan.simulate import FleetConfig, SimRequest


def from_specs(specs: Sequence[Any], seed: int = 0) -> list[SimRequest]:
    """Benchmark ``RequestSpec``s (a loaded JSONL trace) as simulated requests, keys drawn at random."""
    import random

    rng = random.Random(seed)
    return [SimRequest(s.arrival, s.num_prompt_tokens, s.max_tokens, rng.getrandbits(32)) for s in specs]


def synthetic(
    rate: float,
    duration_s: float,
    *,
    process: str = "poisson",
    cv: float = 1.0,
    seed: int = 0,
    mix: Any = None,
    partitions: tuple[list[int], int] | None = None,
) -> list[SimRequest]:
    """The benchmark's synthetic workload (inflight/plan/workload.py: arrival process, length mix) as lengths
    only: an hour of a thousand pods' traffic is millions of requests, and no token id is needed.

    ``partitions = (kept, total)``: only requests whose key lands on a kept partition are built (each
    arrival of the whole stream lands on a uniformly random partition, as hashed keys do), so a
    sampled simulation does not pay for the requests it would drop."""
    import random

    from inflight.plan.workload import LengthMix

    mix = mix or LengthMix()
    kept, total = partitions if partitions is not None else ([0], 1)
    times = _thinned_arrivals(rate, duration_s, process, cv, len(kept) / total, random.Random(seed))
    rng = random.Random(seed + 1_000_003)
    return [
        SimRequest(
            t, mix.prompt_len(rng), mix.output_len(rng), rng.choice(kept) + total * rng.getrandbits(20)
        )
        for t in times
    ]


def _thinned_arrivals(
    rate: float, duration_s: float, process: str, cv: float, keep: float, rng: Any
) -> list[float]:
    """Arrivals of a renewal process (poisson, or gamma gaps of the given CV) with each arrival kept
    with probability ``keep``, generated in O(kept): the gap between kept arrivals is a sum of G gaps,
    G ~ Geometric(keep), and a sum of G gamma(k, theta) gaps is one gamma(G * k, theta) draw."""
    if process == "poisson":
        shape = 1.0
    elif process == "gamma":
        shape = 1.0 / (cv * cv)
    else:
        raise ValueError(f"unknown arrival process {process!r}; use poisson or gamma")
    scale = 1.0 / (rate * shape)
    log_miss = math.log1p(-keep) if keep < 1.0 else None
    times: list[float] = []
    t = 0.0
    while True:
        skipped = 1 if log_miss is None else 1 + int(math.log(1.0 - rng.random()) / log_miss)
        t += rng.gammavariate(shape * skipped, scale)
        if t > duration_s:
            return times
        times.append(t)


def sampled_partitions(fleet: FleetConfig) -> tuple[list[int], int]:
    """The partitions of the workers simulate() runs, and the total."""
    n = fleet.num_partitions
    simulated = min(fleet.workers, fleet.sample_workers or fleet.workers)
    return [p for p in range(n) if p % fleet.workers < simulated], n
