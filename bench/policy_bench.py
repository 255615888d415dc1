"""Scheduling policies on the real engine: fcfs vs priority vs slo vs slo+reject on bursty arrivals.

``python -m bench policies`` (``make bench-policies``). The simulated comparison
(``inflight plan policies``, inflight/plan/policies.py) predicts; this measures, with the same mix,
loads and table:

1. Capacity, measured: four batches of the mix's requests all at t = 0 on the fcfs engine,
   completed requests per second over the middle half of the completions (``measure_capacity``).
2. For each gamma arrival CV and load (a fraction of that capacity), one workload of ``duration_s``
   of arrivals is replayed in real time, open loop, on one in-process engine per policy (the same
   requests and arrival instants for every policy). Short questions (prompt <= 128 tokens) are
   priority 0 and documents priority 1 for the priority policy; the slo policies get the SLO as every
   request's deadlines and the cost model for their estimates.
3. Goodput: requests that completed and met both SLO bounds (bench/stats.py), per second of the run.
4. The load each run met (``effective_load``): its label times the host's speed level during the run
   (measured step time over the cost model's, time-weighted, ``SpeedMeter``) over the level during the
   capacity burst. The host's speed drifts by 20% between two 30 s runs, so a "1.2x" run on a fast
   spell meets about 1.0x of what the engine then sustains, and one on a slow spell 1.4x.

Default SLO, when none is given, from the cost model so the same command means the same on any host:
TTFT 5x the prefill of the longest prompt alone; TPOT the mean of a decode step of half the seats and
of the same step carrying a full prefill chunk (a request may share half its steps with a chunk:
fcfs cannot promise that under bursts, the slo policy can by cutting chunks).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results import RequestResult, RunResult
from bench.stats import summarize
from engine.cost_model import TERMS, StepCostModel
from inflight.plan.slo import SLO
from inflight.plan.workload import LengthMix, RequestSpec, synthetic

POLICIES = ("fcfs", "priority", "slo", "slo+reject")
SHORT_PROMPT_MAX = 128  # the mix's questions are 16-128 tokens, its documents 256-512


@dataclass(frozen=True)
class Grid:
    cvs: tuple[float, ...]
    loads: tuple[float, ...]
    duration_s: float  # seconds of arrivals a run (requests = duration x rate)


# 24 runs of 30 s of arrivals plus their drains, a calibration, the capacity burst and four warm-ups:
# 16-17 minutes on a 2-core host with the bench preset (measured twice). Runs are sized in seconds, not
# requests, so a slower host sends fewer requests, not longer. 10 s was too short to see saturation:
# the backlog a 1.2x load builds in 10 s is 2 s of work, which fcfs still served mostly in time.
DEFAULT_GRID = Grid((2.0, 4.0), (0.8, 1.0, 1.2), 30.0)
# The tiny model, two loads, 2.5 s runs: about a minute.
QUICK_GRID = Grid((2.0, 4.0), (0.8, 1.2), 2.5)


def default_slo(cost: StepCostModel, engine: dict[str, Any], mix: LengthMix) -> tuple[float, float]:
    longest = mix.long_prompt[1]
    seats = max(1, int(engine.get("max_num_seqs", 64)) // 2)
    budget = int(engine.get("max_num_batched_tokens", 512))
    context = seats * (mix.short_prompt[1] + mix.output[1] // 2)
    decode = cost.step_time(seats, seats, context)
    with_chunk = cost.step_time(seats + budget, seats + 1, context + budget)
    return 5 * cost.step_time(longest, 1, longest), (decode + with_chunk) / 2


def policy_engine_args(
    policy: str, slo: tuple[float, float], cost_path: str, base: dict[str, Any]
) -> dict[str, Any]:
    args = {**base, "scheduling_policy": policy.split("+")[0]}
    if policy.startswith("slo"):
        args.update(
            slo_ttft_s=slo[0],
            slo_tpot_s=slo[1],
            slo_cost_model=cost_path,
            slo_reject=policy.endswith("+reject"),
        )
    return args


@dataclass
class SpeedMeter:
    """The host's speed level over the steps it saw: their wall time over what the cost model gives
    the same batches (1.0: as calibrated; 1.2: steps took 20% longer)."""

    cost: StepCostModel
    measured_s: float = 0.0
    modelled_s: float = 0.0

    def observe(self, engine: Any, wall: float) -> None:
        """The engine's last step (its own record of the batch) and the wall time around it."""
        rec = engine.metrics.steps[-1]
        self.measured_s += wall
        self.modelled_s += self.cost.step_time(rec.num_tokens, len(rec.batch), rec.sum_context)

    @property
    def level(self) -> float:
        return self.measured_s / self.modelled_s if self.modelled_s > 0 else math.nan


def drive(
    engine: Any,
    specs: Sequence[RequestSpec],
    label: str,
    rate: float,
    meter: SpeedMeter | None = None,
) -> RunResult:
    """Replay ``specs`` in real time, open loop (a request joins at the first step boundary after it
    arrives; that wait is part of its TTFT). Questions are priority 0, documents 1; a request the slo
    policy rejects ends with its error and counts as not completed. ``meter`` sees every step."""
    from engine.inputs import EngineRequest
    from engine.sampling_params import SamplingParams

    specs = sorted(specs, key=lambda s: s.arrival)
    results = {
        s.request_id: RequestResult(s.request_id, s.arrival, s.num_prompt_tokens, s.max_tokens) for s in specs
    }
    t0 = time.monotonic()
    i = 0
    while i < len(specs) or engine.has_unfinished_requests():
        now = time.monotonic() - t0
        while i < len(specs) and specs[i].arrival <= now:
            s = specs[i]
            params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True)
            priority = int(s.num_prompt_tokens > SHORT_PROMPT_MAX)
            arrival = t0 + s.arrival
            engine.add_request(
                EngineRequest(s.request_id, list(s.prompt_token_ids), params, priority, arrival_time=arrival)
            )
            i += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, specs[i].arrival - now))
            continue
        before = engine.metrics.num_steps
        start = time.monotonic()
        outputs = engine.step()
        t = time.monotonic() - t0
        if meter is not None and engine.metrics.num_steps > before:
            meter.observe(engine, t0 + t - start)
        for out in outputs:
            r = results[out.request_id]
            r.token_times.extend([t] * sum(len(c.token_ids) for c in out.outputs))
            if out.error:
                r.error = out.error
            if out.finished:
                r.finished = t
    return RunResult("continuous", label, rate, list(results.values()))


def _engine(model: str, args: dict[str, Any]) -> Any:
    from inflight.plan.replay import make_engine

    return make_engine(model, args)


def measure_capacity(engine: Any, specs: Sequence[RequestSpec], meter: SpeedMeter | None = None) -> float:
    """Saturated throughput: every request of ``specs`` at t = 0, and completed requests per second
    between the instants a quarter and three quarters of them completed. The start of a burst is a
    wall of prefills with nothing completing, its end a thin batch of the last long answers; neither
    is the engine at saturation, and counting them (the makespan, or up to the 90th percentile as
    this did before) put "1.2x capacity" at about 0.95x of what the engine sustains, where fcfs still
    met most SLOs in a 30 s run."""
    burst = [RequestSpec(f"cap-{s.request_id}", 0.0, s.prompt_token_ids, s.max_tokens) for s in specs]
    run = drive(engine, burst, "capacity", math.inf, meter)
    return steady_rate([r.token_times[-1] for r in run.requests if r.completed and r.token_times])


def cost_terms(cost: StepCostModel) -> dict[str, float]:
    """What a host level is measured against: the cost model's coefficients."""
    return {t: float(getattr(cost, t)) for t in (*TERMS, "first_shape")}


def check_pin(pinned: dict[str, Any], model: str, engine: dict[str, Any], terms: dict[str, float]) -> None:
    """A capacity is another run's only if it measured the same engine, and its host level means the
    same only against the same cost model: refuse anything else rather than label loads wrongly."""
    if pinned.get("source") != "measured" or "capacity_host_level" not in pinned:
        raise ValueError("pin the capacity of a measured run (python -m bench policies), not a simulated one")
    for what, mine, theirs in (
        ("model", model, pinned.get("model")),
        ("engine settings", engine, pinned.get("engine")),
        ("cost model", terms, pinned.get("cost_terms")),
    ):
        if theirs is None:
            raise ValueError(f"the pinned run records no {what} (it predates --capacity-from): cannot check")
        if mine != theirs:
            raise ValueError(f"the pinned capacity was measured with other {what}: {theirs} (here {mine})")


def steady_rate(ends: Sequence[float]) -> float:
    """Completions per second between the quarter and the three-quarter completion."""
    ends = sorted(ends)
    if len(ends) < 8:
        raise RuntimeError(f"only {len(ends)} requests completed in the capacity burst")
    lo, hi = len(ends) // 4, (3 * len(ends)) // 4
    return (hi - lo) / (ends[hi] - ends[lo])


def row(cv: float, load: float, rate: float, policy: str, run: RunResult, slo: SLO) -> dict[str, Any]:
    s = summarize(run, slo)
    good = sum(1 for r in run.requests if slo.met(r))
    done = [r for r in run.requests if r.completed]
    return {
        "cv": cv,
        "load": load,
        "rate": rate,
        "policy": policy,
        "num_requests": s["num_requests"],
        "num_completed": s["num_completed"],
        "num_good": good,
        "num_rejected_slo": sum(1 for r in run.requests if r.error and "slo_ttft_unmet" in r.error),
        # Completed but late, by bound (a request late on both counts in both).
        "num_ttft_missed": sum(
            1 for r in done if slo.ttft_s is not None and (r.ttft is None or r.ttft > slo.ttft_s)
        ),
        "num_tpot_missed": sum(
            1 for r in done if slo.tpot_s is not None and r.tpot is not None and r.tpot > slo.tpot_s
        ),
        "duration_s": s["duration_s"],
        "goodput_req_s": s["goodput"],
        "request_throughput": s["request_throughput"],
        "output_tok_s": s["output_throughput"],
        "ttft_p99_s": s["ttft"]["p99_ms"] / 1e3,
        "tpot_p99_s": s["tpot"]["p99_ms"] / 1e3,
    }


def compare(
    model: str,
    cost_path: str,
    grid: Grid,
    *,
    engine: dict[str, Any],
    slo: tuple[float, float] | None = None,
    mix: LengthMix | None = None,
    seed: int = 0,
    policies: Sequence[str] = POLICIES,
    repeats: int = 1,
    pinned: dict[str, Any] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """The whole comparison; rows in the simulated version's format (inflight/plan/policies.py).
    With ``repeats`` each cell runs every policy that many times, in turn (fcfs, slo, fcfs, slo, ...
    with the first rotating): on a host whose speed drifts by 20% between two 30 s runs, one pair of
    runs says little, and each repeat's ratio to its own fcfs run pairs runs made close together.

    ``pinned``: an earlier measured result whose capacity (and the host level it was measured at)
    this run reuses instead of measuring its own burst, so that two runs' "1.0x" are the same
    arrival rate and their met loads are measured against the same reference. It must come from the
    same model, engine settings and cost model (see check_pin)."""
    if "fcfs" not in policies:
        raise ValueError("the comparison is against fcfs: include it in policies")
    policies = tuple(p for p in POLICIES if p in policies)
    from engine.config import ModelConfig

    mix = mix or LengthMix()
    cost = StepCostModel.load(cost_path)
    terms = cost_terms(cost)
    if pinned is not None:  # before building engines: a wrong pin fails at once
        check_pin(pinned, model, engine, terms)
    slo = slo or default_slo(cost, engine, mix)
    bounds = SLO(*slo)
    vocab = ModelConfig.from_path(model).vocab_size
    engines = {p: _engine(model, policy_engine_args(p, slo, cost_path, engine)) for p in policies}
    if pinned is not None:
        cap, cap_level = float(pinned["capacity_req_s"]), float(pinned["capacity_host_level"])
        how = f"pinned: measured earlier at host level {cap_level:.2f}"
    else:
        # Four batches' worth: the middle half of the completions comes from a full engine.
        n = 4 * int(engine.get("max_num_seqs", 64))
        probe = synthetic(n, 1.0, vocab, mix=mix, seed=seed, prefix="cap")
        cap_meter = SpeedMeter(cost)
        cap = measure_capacity(engines["fcfs"], probe, cap_meter)
        cap_level = cap_meter.level
        how = f"measured burst of {len(probe)}, host level {cap_level:.2f}"
    log(f"capacity {cap:.2f} req/s ({how}); SLO {bounds.describe()}")
    rows = []
    cells = [(cv, load) for cv in grid.cvs for load in grid.loads]
    for k, (cv, load) in enumerate(cells):
        rate = load * cap
        n = max(4, round(grid.duration_s * rate))
        specs = synthetic(
            n, rate, vocab, process="gamma", cv=cv, mix=mix, seed=seed, prefix=f"cv{cv}-l{load}"
        )
        # Every policy in turn on the same requests, the first one rotating from cell to cell (and
        # repeat to repeat): the first to meet a token count pays its shape's one-off cost (oneDNN's
        # primitive cache is per process, shared by the engines), and host drift lands on every
        # policy alike.
        for rep in range(repeats):
            turn = (k * repeats + rep) % len(policies)
            for policy in policies[turn:] + policies[:turn]:
                meter = SpeedMeter(cost)
                run = drive(engines[policy], specs, f"cv={cv} load={load}", rate, meter)
                r = row(cv, load, rate, policy, run, bounds)
                r["repeat"] = rep
                r["host_level"] = meter.level
                r["effective_load"] = load * meter.level / cap_level
                rows.append(r)
                log(
                    f"cv {cv:g} load {load:g} (met {r['effective_load']:.2f}) {policy:<10} goodput "
                    f"{r['goodput_req_s']:.2f} req/s "
                    f"({r['num_good']}/{r['num_requests']}; late TTFT {r['num_ttft_missed']}, TPOT "
                    f"{r['num_tpot_missed']}, rejected {r['num_rejected_slo']}), TTFT p99 "
                    f"{r['ttft_p99_s']:.2f}s, TPOT p99 {1e3 * r['tpot_p99_s']:.0f}ms"
                )
    rows.sort(key=lambda r: (r["cv"], r["load"], r["repeat"], POLICIES.index(r["policy"])))
    return {
        "source": "measured",
        "model": model,
        "capacity_req_s": cap,
        "capacity_host_level": cap_level,
        "capacity_pinned": pinned is not None,
        "cost_terms": terms,
        "slo": {"ttft_s": slo[0], "tpot_s": slo[1]},
        "engine": engine,
        "grid": {"cvs": list(grid.cvs), "loads": list(grid.loads), "duration_s": grid.duration_s},
        "repeats": repeats,
        "rows": rows,
    }


def add_arguments(p: Any) -> None:
    p.add_argument("--cost", default=None, help="COST.json (default: calibrate first, on these settings)")
    p.add_argument("--slo", nargs="+", default=None, help="ttft:MS tpot:MS (default: from the cost model)")
    p.add_argument("--cvs", default=None, help="gamma arrival CVs (default 2,4)")
    p.add_argument("--loads", default=None, help="offered load as fractions of capacity (default 0.8,1,1.2)")
    p.add_argument("--out", default="plan-policies", help="directory for policies.json and policies.png")
    p.add_argument("--quick", action="store_true", help="tiny model, loads 0.8 and 1.2, 2.5 s runs")
    p.add_argument("--model", default=None, help="checkpoint (default: bench preset; --quick: tiny)")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals a run")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's default)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--policies", default=None, help="comma list, fcfs among them (default fcfs,priority,slo,slo+reject)"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="runs of every policy a cell, in turn (paired ratios to fcfs)"
    )
    p.add_argument(
        "--capacity-from",
        default=None,
        help="an earlier run's policies.json: reuse its measured capacity and host level instead of a "
        "burst, so both runs' loads are the same arrival rates (same model, settings and --cost)",
    )


def main(args: Any) -> int:
    """``python -m bench policies``: measure, then write policies.json and policies.png and print the
    table, as ``inflight plan policies`` does for the simulation."""
    from inflight.plan.policies import plot, table
    from inflight.plan.slo import parse_slo

    bounds: tuple[float, float] | None = None
    if args.slo:
        slo = parse_slo(args.slo)
        if slo.ttft_s is None or slo.tpot_s is None:
            raise SystemExit("--slo needs both ttft:MS and tpot:MS")
        bounds = (slo.ttft_s, slo.tpot_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run_from_args(args, bounds, out)
    (out / "policies.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "policies.png")
    print(table(result))
    print(f"wrote {out / 'policies.json'} and {out / 'policies.png'}")
    return 0


def run_from_args(args: Any, slo: tuple[float, float] | None, out: Any) -> dict[str, Any]:
    """Settle the model, cost model and grid, then compare."""
    import torch

    from engine.models.tiny import default_model_path
    from inflight.plan import calibrate as cal

    policies = tuple(args.policies.split(",")) if args.policies else POLICIES
    unknown = set(policies) - set(POLICIES)
    if unknown:
        raise SystemExit(f"unknown policies {sorted(unknown)}; choose from {', '.join(POLICIES)}")
    if "fcfs" not in policies:
        raise SystemExit("the comparison is against fcfs: include it in --policies")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    grid = QUICK_GRID if args.quick else DEFAULT_GRID
    grid = Grid(
        tuple(float(x) for x in args.cvs.split(",")) if args.cvs else grid.cvs,
        tuple(float(x) for x in args.loads.split(",")) if args.loads else grid.loads,
        args.duration or grid.duration_s,
    )
    if args.model:
        model = args.model
    elif args.quick:
        model = str(default_model_path())
    else:
        from inflight.plan.workload import bench_model_path

        model = str(bench_model_path())
    engine = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        # The mix needs 512 + 256 tokens; four engines share the host's memory, so each holds KV for
        # its seats at this length, not the 2 GiB a lone engine may take.
        "max_model_len": 1024,
        "num_blocks": args.max_num_seqs * 1024 // 16,
        "enable_prefix_caching": False,  # random prompts: a prefix hit would be luck, on one policy only
        "async_scheduling": False,  # as calibrated (see inflight/commands/plan.py SEQUENTIAL_STEPS)
    }
    cost_path = args.cost
    if cost_path is None:  # the slo policy's estimates: timed here, on these settings and threads
        cost = cal.calibrate(
            model, cal.QUICK_GRID if args.quick else cal.DEFAULT_GRID, engine_args=engine, log=lambda _: None
        )
        cost_path = str(out / "cost.json")
        cost.save(cost_path)
        print(cal.describe(cost), flush=True)
    return compare(
        model,
        cost_path,
        grid,
        engine=engine,
        slo=slo,
        seed=args.seed,
        policies=policies,
        repeats=args.repeats,
        pinned=json.loads(Path(args.capacity_from).read_text()) if args.capacity_from else None,
    )
