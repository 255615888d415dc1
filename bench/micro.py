"""A decode step at a full batch next to the rate of its linear layers alone, measured side by side.

A decode step at B running requests does, per layer, the linear layers on B rows plus attention over
each request's context; its useful FLOPs are

    2 * B * linear_params + sum over requests and layers of 4 * num_heads * head_dim * context

(2 per multiply-add; attention is Q.K^T and P.V). Its linear layers alone are timed two ways:

  packed  the loaded model's own weights through the engine's own ``matmul`` (engine/layers/linear.py):
          oneDNN-packed bf16 weights where the engine packs them, at the row count the engine pads
          a step to (engine/models/onednn.py), the LM head on the rows that sample. This is what the
          step itself runs, so step time / packed time is what the step adds around its matmuls.
  raw     ``F.linear`` on fresh random, unpacked weights of the same shapes at B rows, one weight
          per shape reused for every layer: the plain torch matmul rate. Unfair to the step both
          ways: in bf16 F.linear repacks the weight on every call (the engine packed it once), and
          a model small enough for the cache keeps the reused weight there.

The ratio of the step's useful FLOP/s to a matmul rate says how much of the step is spent doing
matmul-rate work; the rest is attention, pointwise ops, sampling and host overhead.

The three are measured in alternation, several rounds, and compared by their medians, so a slow
moment of a shared machine hits all of them alike.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from bench.results import RunResult
from engine.config import ModelConfig
from engine.layers.linear import matmul
from engine.llm_engine import LLMEngine
from engine.models import cpu_gemm
from engine.models.decoder import DecoderModel
from engine.sampling_params import SamplingParams
from inflight.plan.workload import random_prompt


def linear_shapes(mc: ModelConfig) -> list[tuple[int, int, int]]:
    """(in_features, out_features, count) of every linear layer, merged as the engine runs them."""
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    layers = mc.num_hidden_layers
    return [
        (mc.hidden_size, q + 2 * kv, layers),  # qkv_proj
        (q, mc.hidden_size, layers),  # o_proj
        (mc.hidden_size, 2 * mc.intermediate_size, layers),  # gate_up_proj
        (mc.intermediate_size, mc.hidden_size, layers),  # down_proj
        (mc.hidden_size, mc.vocab_size, 1),  # lm_head
    ]


def linear_params(mc: ModelConfig) -> int:
    return sum(i * o * n for i, o, n in linear_shapes(mc))


def attention_flops(mc: ModelConfig, context_lens: list[int]) -> int:
    return 4 * mc.num_attention_heads * mc.head_dim * mc.num_hidden_layers * sum(context_lens)


def run_decode_share(run: RunResult, mc: ModelConfig, batch: int, matmul_gflops: float) -> tuple[float, int]:
    """The probe's figure over a benchmark run's decode-only steps at ``batch`` sequences: real
    contexts instead of the probe's short ones (the matmul rate still comes from the probe)."""
    steps = [s for s in run.steps if s.is_decode_only and s.num_scheduled_seqs == batch]
    if not steps or matmul_gflops <= 0:
        return math.nan, 0
    flops = sum(
        2 * batch * linear_params(mc) + attention_flops(mc, [b + 1 for _, _, b in s.batch]) for s in steps
    )
    seconds = sum(s.duration for s in steps)
    return flops / seconds / (matmul_gflops * 1e9), len(steps)


class MatmulProbe:
    """The model's linear layers at ``rows`` rows through ``F.linear`` on fresh random, unpacked
    weights, run in model order; time one full pass."""

    def __init__(self, mc: ModelConfig, rows: int, dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(0)
        self.rows = rows
        self.ops = [
            (
                torch.randn(rows, i, generator=gen, dtype=dtype),
                torch.randn(o, i, generator=gen, dtype=dtype),
                n,
            )
            for i, o, n in linear_shapes(mc)
        ]
        self.flops = 2 * rows * linear_params(mc)

    @torch.inference_mode()
    def time_pass(self) -> float:
        start = time.perf_counter()
        for x, w, n in self.ops:
            for _ in range(n):
                F.linear(x, w)
        return time.perf_counter() - start


class ModelLinearsProbe:
    """Every linear layer of a loaded model (qkv with its bias where the model has one, o, gate_up
    and down per layer, then the LM head) through the engine's ``matmul`` on the model's own weights,
    packed as the engine packed them, for a decode step of ``rows`` sequences: at the row count the
    model pads that step to, the LM head at the rows that sample (one per sequence, padded alike).
    ``flops`` counts the useful FLOPs at ``rows``: padding costs time, not work."""

    def __init__(self, model: DecoderModel, rows: int, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(0)
        kernels = model.kernels
        self.rows = rows
        self.padded_rows = kernels.padded_rows(rows)
        inputs: dict[int, torch.Tensor] = {}

        def x(features: int) -> torch.Tensor:
            if features not in inputs:
                inputs[features] = torch.randn(self.padded_rows, features, generator=gen, dtype=dtype)
            return inputs[features]

        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        for w, bias in model.linear_weights():
            assert isinstance(w, torch.Tensor), "the probe times float weights (quantization='none')"
            self.calls.append((x(cpu_gemm.features(w)[1]), w, bias))
        self.kernels = kernels
        self.flops = 2 * rows * sum(math.prod(cpu_gemm.features(w)) for _, w, _ in self.calls)

    @torch.inference_mode()
    def time_pass(self) -> float:
        kernels = self.kernels
        start = time.perf_counter()
        for x, w, b in self.calls:
            matmul(x, w, b, kernels)
        return time.perf_counter() - start


@dataclass
class DecodeProbeResult:
    batch: int
    context_mean: float
    rounds: int
    linear_rows: int  # the rows the engine's linears ran at: batch, padded as the model pads it
    packed_linear_ms: float  # the model's own ops.linear on its packed weights, one pass, median
    raw_linear_ms: float  # F.linear on fresh random unpacked weights at batch rows, one pass, median
    packed_matmul_gflops: float  # useful linear FLOPs / packed_linear_ms
    raw_matmul_gflops: float  # useful linear FLOPs / raw_linear_ms
    step_ms: float  # whole engine.step(), median
    model_ms: float  # model + sampling only (execute - prepare), median
    step_gflop: float  # useful FLOPs of the measured step
    step_gflops: float  # step_gflop / step time
    step_share_of_packed_rate: float  # step_gflops / packed_matmul_gflops: the ">= 50%" target
    step_share_of_raw_rate: float  # step_gflops / raw_matmul_gflops
    model_share_of_packed_rate: float  # the packed share over model time only
    sched_prep_share: float  # (schedule + input preparation) / whole step, median
    schedule_ms: float
    prepare_ms: float
    kv_empty_slot_share: float  # allocated-but-empty KV slots / used slots, at the measured steps

    @property
    def step_over_linear(self) -> float:
        """Whole step time / its linear layers' time (packed): what the step adds around them."""
        return self.step_ms / self.packed_linear_ms

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "step_over_linear": self.step_over_linear}


def decode_probe(
    model: str,
    *,
    batch: int = 64,
    prompt_len: int = 128,
    rounds: int = 8,
    block_size: int = 16,
    max_num_batched_tokens: int = 512,
    seed: int = 0,
    dtype: str = "float32",
    attention_backend: str = "auto",
) -> DecodeProbeResult:
    """Fill an engine with ``batch`` requests, finish their prefills, then alternate a raw and a packed
    pass over the linear layers with one decode step, ``rounds`` times. Short prompts keep the set-up
    prefill cheap; the context (and so attention's share) is reported with the result."""
    import random

    rng = random.Random(seed)
    budget = max(max_num_batched_tokens, batch)
    # Early requests decode while later ones prefill: leave them enough tokens to outlast the probe.
    new_tokens = rounds + 4 + -(-batch * prompt_len // budget)
    engine = LLMEngine.from_engine_args(
        model,
        max_num_seqs=batch,
        max_num_batched_tokens=budget,
        block_size=block_size,
        num_blocks=batch * (-(-(prompt_len + new_tokens + 1) // block_size)) + 1,
        max_model_len=prompt_len + new_tokens + 8,
        enable_prefix_caching=False,
        dtype=dtype,
        attention_backend=attention_backend,
        seed=seed,
    )
    mc = engine.config.model
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"probe-{i}", list(random_prompt(prompt_len, mc.vocab_size, rng)), params)
    # Run until every request has its first token: from then on each step is a pure decode of all.
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()
    probe = MatmulProbe(mc, batch, engine.config.dtype)
    packed = ModelLinearsProbe(engine.runner.model, batch, engine.config.dtype)
    assert packed.flops == probe.flops, "the model's linears are not the shapes linear_shapes counts"
    probe.time_pass()  # first call: allocation
    packed.time_pass()
    engine.step()  # one unmeasured decode step, for the same reason
    raw, mm, steps, models, scheds, preps, empties, flops, ctx = [], [], [], [], [], [], [], [], []
    for _ in range(rounds):
        raw.append(probe.time_pass())
        mm.append(packed.time_pass())
        running = list(engine.scheduler.running)
        assert len(running) == batch, "a request left the batch early"
        contexts = [r.num_tokens for r in running]  # the new token's position + 1
        ctx.append(sum(contexts) / len(contexts))
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        rec = engine.metrics.steps[-1]
        assert rec.stats.num_scheduled_seqs == batch and rec.stats.num_scheduled_tokens == batch
        models.append(rec.execute_time - rec.prepare_time)
        scheds.append(rec.schedule_time)
        preps.append(rec.prepare_time)
        bs = engine.config.block_size
        # A request may finish in the measured step (its blocks are freed then): count those that remain.
        held = [r for r in running if engine.kv.block_ids(r.request_id)]
        used = sum(len(engine.kv.block_ids(r.request_id)) * bs for r in held)
        empties.append((used - sum(r.num_computed_tokens for r in held)) / max(used, 1))
        flops.append(probe.flops + attention_flops(mc, contexts))
    med = statistics.median
    packed_rate = packed.flops / med(mm)
    raw_rate = probe.flops / med(raw)
    step_rate = med(flops) / med(steps)
    return DecodeProbeResult(
        batch=batch,
        context_mean=sum(ctx) / len(ctx),
        rounds=rounds,
        linear_rows=packed.padded_rows,
        packed_linear_ms=1e3 * med(mm),
        raw_linear_ms=1e3 * med(raw),
        packed_matmul_gflops=packed_rate / 1e9,
        raw_matmul_gflops=raw_rate / 1e9,
        step_ms=1e3 * med(steps),
        model_ms=1e3 * med(models),
        step_gflop=med(flops) / 1e9,
        step_gflops=step_rate / 1e9,
        step_share_of_packed_rate=step_rate / packed_rate,
        step_share_of_raw_rate=step_rate / raw_rate,
        model_share_of_packed_rate=(med(flops) / med(models)) / packed_rate,
        sched_prep_share=med([(s + p) / t for s, p, t in zip(scheds, preps, steps, strict=True)]),
        schedule_ms=1e3 * med(scheds),
        prepare_ms=1e3 * med(preps),
        kv_empty_slot_share=sum(empties) / len(empties),
    )
