"""Time the engine's own steps over a grid of batch shapes and fit ``engine.cost_model``.

Each grid point is a small workload run through ``LLMEngine.step`` as it serves requests: a lone
prompt of P tokens (a prefill step of P tokens), and S prompts of C tokens decoding together (prefill
steps of several rows, then decode steps of S rows at context about S * C). Every step after a
warm-up is one sample: its wall time around ``step()`` (scheduling, the model, sampling and
detokenizing: what a simulated step must cost) against the batch it ran, read from the engine's own
step record. The first step of each token count is kept apart: it pays a one-off cost for the new
shape, which the grid's repeats (the same shapes again) do not, and which the linear terms must not
absorb (it would inflate every small step's fixed cost and leave prefills short); it is fitted on its
own as ``first_shape``. Last, a few seconds of the benchmark's mix served open loop (``_serve``): the
steps a planner is asked about, in the order serving runs them.
"""

from __future__ import annotations

import math
import os
import platform
import random
import time
from dataclasses import dataclass, replace
from typing import Any

from engine.cost_model import StepCostModel
from engine.models.row_padding import RowPadding
from inflight.plan.fit import StepSample, fit
from inflight.plan.replay import StepTiming, engine_padding, note_shape


@dataclass(frozen=True)
class Grid:
    prefill_tokens: tuple[int, ...]
    decode_seqs: tuple[int, ...]
    contexts: tuple[int, ...]
    max_sum_context: int  # skip (seqs, context) points above this: their prefill alone takes long
    decode_steps: int  # decode steps recorded per (seqs, context) point
    repeats: int
    served_s: float = 0.0  # then this many seconds of the benchmark's mix served open loop (see _serve)


# About 15 s on a quiet 2-core host with the bench preset (grid only, two threads) plus 20 s served, a
# minute or more when other work shares the cores; --quick is a few seconds, for tests. The served
# segment sets the model's level (inflight.plan.fit.fit) and its noise, so it is the longer part: its
# steps drift with the host for seconds at a time (lag-1 correlation 0.93 of the slow part), and 10 s
# holds only a few such stretches.
DEFAULT_GRID = Grid((16, 128, 512), (1, 4, 16, 48), (32, 256, 1024), 12288, 8, 2, served_s=20.0)
QUICK_GRID = Grid((16, 128), (1, 4, 8, 16), (32, 192), 4096, 8, 2, served_s=1.0)
# One-thread calibration: above this share of step time spent waiting for a core, describe() warns.
BUSY_HOST_SHARE = 0.05


def host_info(threads: int) -> dict[str, Any]:
    from engine.platform.cpu import cpu_flags, cpu_model_name

    interesting = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "fma")
    return {
        "cpu": cpu_model_name(),
        "cpu_flags": sorted(f for f in interesting if f in cpu_flags()),
        "threads": threads,
        "cpus_allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


@dataclass
class Timed:
    """A calibration's measurements, before the fit: what several workers' calibrations pool."""

    samples: list[StepSample]  # steps of token counts the process had run before
    first_shape: list[StepSample]  # steps of a token count the process had not run before
    served: list[StepSample]  # the served segment's steps in the order they ran (the noise's)
    waited: float  # wall - CPU time over the timed steps (one thread: time spent waiting for a core)
    settings: dict[str, Any]  # the engine settings (_settings)
    padding: RowPadding  # the engine's row padding
    threads: int


def calibrate(model: str, grid: Grid, *, engine_args: dict[str, Any], log: Any = print) -> StepCostModel:
    from engine.llm_engine import LLMEngine

    timed = time_steps(LLMEngine.from_engine_args(model, **engine_args), model, grid)
    new = len(timed.first_shape)
    log(f"{len(timed.samples) + new} steps timed ({new} of a new token count)")
    return fit_timed([timed])


def time_steps(eng: Any, model: str, grid: Grid) -> Timed:
    """Time ``eng``'s steps over ``grid`` (see the module docstring)."""
    import torch

    from engine.sampling_params import SamplingParams

    cfg = eng.config
    rng = random.Random(0)
    vocab = cfg.model.vocab_size
    samples: list[StepSample] = []
    first_shape: list[StepSample] = []
    waited = 0.0
    counter = 0

    def add(n: int, params: SamplingParams) -> None:
        nonlocal counter
        counter += 1
        eng.add_request(f"cal-{counter}", [rng.randrange(4, vocab) for _ in range(n)], params)

    def run(prompts: list[int], max_tokens: int, keep: bool, join: int = 0) -> None:
        """Serve ``prompts``; with ``join``, a prompt of that many tokens arrives once they all decode,
        so steps that mix a prefill chunk into decodes (what a served batch mostly is) are timed too."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for n in prompts:
            add(n, params)
        while eng.has_unfinished_requests():
            if (
                join
                and all(r.num_output_tokens > 0 for r in eng.scheduler.running)
                and not eng.scheduler.waiting
            ):
                add(join, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
                join = 0
            nonlocal waited
            before = eng.metrics.num_steps
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            eng.step()
            seconds = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            if eng.metrics.num_steps == before:
                continue
            rec = eng.metrics.steps[-1]
            new = note_shape(rows(rec.num_tokens)) < 0
            if keep:
                waited += max(0.0, seconds - cpu)
                sample = StepSample(rec.num_tokens, len(rec.batch), rec.sum_context, seconds)
                (first_shape if new else samples).append(sample)

    padding = engine_padding(eng)
    rows = padding.padded
    for size in padding.built():  # built when the model loaded
        note_shape(size)
    run([24, 130], 4, keep=False)  # warm-up: first-call allocations happen here
    budget, max_len = cfg.max_num_batched_tokens, cfg.max_model_len
    for _ in range(grid.repeats):
        for p in grid.prefill_tokens:
            if p <= min(budget, max_len - 2):
                run([p], 1, keep=True)
        for s in grid.decode_seqs:
            for c in grid.contexts:
                if (
                    s <= cfg.max_num_seqs
                    and s * c <= grid.max_sum_context
                    and c + grid.decode_steps < max_len
                ):
                    join = max((p for p in grid.prefill_tokens if p <= min(budget, max_len - 2)), default=0)
                    run([c] * s, grid.decode_steps + 1, keep=True, join=join)
    served: list[StepSample] = []
    if grid.served_s > 0:
        grid_fit = fit(
            samples, first_shape_samples=first_shape, engine=_settings(model, eng), row_padding=padding
        )
        for step in _serve(eng, grid.served_s, grid_fit):
            waited += max(0.0, step.wall - step.cpu)
            sample = StepSample(step.num_tokens, step.num_seqs, step.sum_context, step.wall)
            (first_shape if step.new_shape else samples).append(sample)
            if not step.new_shape:
                served.append(sample)
    return Timed(
        samples,
        first_shape,
        served,
        waited,
        _settings(model, eng),
        padding,
        torch.get_num_threads(),
    )


def fit_timed(timed: list[Timed]) -> StepCostModel:
    """One cost model from one or more calibrations of the same engine settings (workers timed side
    by side pool their steps; the noise is measured on each one's served steps in turn)."""
    first = timed[0]
    samples = [s for t in timed for s in t.samples]
    first_shape = [s for t in timed for s in t.first_shape]
    cost = fit(
        samples,
        host=host_info(first.threads),
        engine=first.settings,
        first_shape_samples=first_shape,
        row_padding=first.padding,
        noise_samples=[s for t in timed for s in t.served],
    )
    if first.threads == 1:
        # A busy host stretches steps by the time the process waits for a core: a model fitted on
        # such steps predicts that host's load, not the engine. Kept so describe() can say so.
        total = sum(s.seconds for s in samples) + sum(s.seconds for s in first_shape)
        waited = sum(t.waited for t in timed)
        cost = replace(cost, fit={**cost.fit, "waiting_for_cpu_share": waited / total})
    return cost


def _settings(model: str, eng: Any) -> dict[str, Any]:
    """The engine settings a cost model was measured with (the simulator's schedulers run with them)."""
    cfg = eng.config
    return {
        "model": model,
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "attention_backend": cfg.attention_backend,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_model_len": cfg.max_model_len,
        "block_size": cfg.block_size,
        "num_blocks": eng.kv.num_total_blocks,
        "kv_free_window": cfg.model.kv_free_window,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "enable_chunked_prefill": cfg.enable_chunked_prefill,
        "device": str(cfg.device),
    }


def _serve(eng: Any, seconds: float, grid_fit: StepCostModel) -> list[StepTiming]:
    """Steps of the benchmark's mix served open loop at 0.7x the capacity the grid's fit simulates.

    The grid times each batch shape in a tight loop of its own; served, a decode step follows prefill
    chunks of other lengths (caches cold after them), batches change row by row and token counts are
    new. On the tiny engine the grid alone predicted a served run's steps 27-42% short by kind; a
    served segment in the samples measures the mix a planner is asked about. Its trace (seed 4242)
    is not the validation's."""
    from inflight.plan.policies import capacity
    from inflight.plan.replay import replay
    from inflight.plan.workload import LengthMix, synthetic

    cfg = eng.config
    half, quarter = cfg.max_model_len // 2, cfg.max_model_len // 4
    mix = LengthMix(
        short_prompt=(16, max(16, min(128, quarter))),
        long_prompt=(max(16, min(256, quarter)), max(16, min(512, half))),
        output=(8, max(8, min(256, quarter))),
    )
    rate = 0.7 * capacity(grid_fit, 200, {}, 4242)
    # At most four batches' worth: if the grid's fit overrates the engine, the backlog stays short.
    n = max(8, min(round(seconds * rate), 4 * cfg.max_num_seqs))
    specs = synthetic(n, rate, cfg.model.vocab_size, mix=mix, seed=4242, prefix="cal")
    run = replay(eng, specs, time.monotonic(), {s.request_id: s.num_prompt_tokens for s in specs})
    return run.steps


def describe(cost: StepCostModel) -> str:
    from inflight.plan.presets import estimate_line

    if (estimate := estimate_line(cost)) is not None:  # a roofline preset (plan/presets.py), not measured
        return estimate + "\n" + describe(replace(cost, host={**cost.host, "estimate": False}))
    f = cost.fit
    text = (
        f"T(step) = {cost.fixed * 1e3:.3f} ms + {cost.per_token * 1e6:.2f} us/token + "
        f"{cost.per_seq * 1e6:.2f} us/seq + {cost.per_context * 1e9:.2f} ns/context token "
        f"(+ {cost.first_shape * 1e3:.2f} ms the first time a token count runs)\n"
        f"fit over {int(f.get('num_samples', 0))} steps: relative RMS error "
        f"{100 * f.get('rel_rms', 0):.1f}%, worst {100 * f.get('rel_max', 0):.1f}%"
    )
    if cost.noise_sigma > 0:
        text += (
            f"\nserved steps vary around it: std of log(measured / model) {cost.noise_sigma:.3f}; "
            f"{100 * (1 - cost.noise_slow_share):.0f}% of that variance fast (lag-1 correlation "
            f"{cost.noise_phi:.2f}), {100 * cost.noise_slow_share:.0f}% slow (lag-1 correlation "
            f"{cost.noise_slow_phi:.3f}); the simulator draws each step's factor from it"
        )
    level = f.get("level_log_std", 0.0)
    if level > 0:
        text += (
            f"\nits level, from {int(f.get('num_served_samples', 0))} served steps, is known to "
            f"x{math.exp(-level):.2f}-x{math.exp(level):.2f} (one standard deviation of the noise's mean)"
        )
    waited = f.get("waiting_for_cpu_share")
    if waited is not None:
        text += f"\nwaiting for a core: {100 * waited:.1f}% of step time"
        if waited > BUSY_HOST_SHARE:
            text += " (the host is busy: the model includes its load; calibrate again on a quiet host)"
    return text
