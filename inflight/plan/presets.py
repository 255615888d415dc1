"""Step-cost presets for GPUs this project cannot measure on: a roofline ESTIMATE, not a calibration.

``inflight plan calibrate`` times the engine's own steps on the host it runs on; that is the only
measured cost model. For a GPU we have no access to (say Llama-3-8B in bf16 on one H200) a preset
derives the step times from the GPU's datasheet peaks and the model's shape, so that
``plan simulate`` / ``plan size`` can be run before any hardware is bought. Every preset is marked
``host["estimate"] = True``: ``describe`` and the planner commands say so, until a real calibration
on the hardware replaces it.

The roofline of one step, whose rows are (new tokens n, tokens already cached c), in two phases
that run one after the other (their kernels do not overlap), each taking the max of its memory time
(at ``bandwidth * mbu``) and its compute time (at dense bf16 ``peak * mfu``):

* linear layers: memory, every streamed weight once (all linear layers and the LM head; not an untied
  embedding table, of which a step gathers only its own rows); compute, 2 FLOPs per weight per token
  (the LM head only for the one sampled position of each row, as the engine computes logits);
* attention: memory, each row's KV context read once (sum_context * kv_bytes_per_token) and the new
  tokens' KV written; compute, per (query token, key token) pair and layer 2 * heads * head_dim FLOPs
  for Q.K^T and as many for P.V, so ``4 * layers * heads * head_dim`` a pair, with
  n * c + n * (n + 1) / 2 pairs a row (causal);
* time = linear + attention + a fixed per-step overhead (CPU scheduling, input preparation, kernel
  launches) + a per-row overhead (sampling, detokenizing, bookkeeping).

A single max over the whole step would let a big decode batch's KV reads hide its matmuls (they do
not: the GEMMs and the attention kernel run in turn); ``breakdown`` also reports the whole-step
memory-bound and compute-bound sums.

What it leaves out (why it is an estimate): activation traffic (under 10% of a prefill's time at
this scale), a finer per-kernel roofline (each GEMM, norm and activation meets its own knee; a
phase's max is optimistic near the linear layers' knee, about 140 tokens a step on an H200), the
attention kernels' own efficiency at short contexts, quantisation, and anything the host adds beyond
the two overhead figures. Tensor parallelism (``--tp``) is itself an estimate: each rank does 1/tp of
the work, then ring all-reduces at a share of the GPU link's bandwidth plus a fixed latency each, with
no overlap of communication and compute.

The cost model is linear and the roofline is a max, so the preset is not the sum of the roofline's
terms: the roofline is evaluated on a grid of serving batch shapes (decode batches of 1..max_num_seqs
at contexts 128..max_model_len, prefill chunks up to the token budget, decodes with a chunk mixed in)
and fitted with ``inflight.plan.fit.fit`` like a calibration, so its ``fit`` stats (rel_rms, rel_max)
say how well the linear form follows the roofline. Pure Python.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from engine.cost_model import StepCostModel
from inflight.plan.fit import StepSample, fit
from inflight.plan.shapes import (  # noqa: F401  (re-exported: the planner's one import)
    GB,
    GIB,
    GPUS,
    MODELS,
    Gpu,
    ModelShape,
    PresetError,
    gpu_spec,
    model_shape,
    shape_from_config,
)


@dataclass(frozen=True)
class Assumptions:
    """What the roofline assumes beyond the datasheet; none of it is measured."""

    mbu: float = 0.8  # share of peak HBM bandwidth a step's reads get
    mfu: float = 0.5  # share of peak dense bf16 FLOP/s a step's matmuls and attention get
    step_overhead_s: float = 1.5e-3  # CPU scheduling, input preparation, launches (no CUDA graphs)
    seq_overhead_s: float = 10e-6  # per row: sampling, detokenizing, bookkeeping
    gpu_memory_utilization: float = 0.9  # share of HBM the engine may use (weights, activations, KV)
    reserve_bytes: float | None = None  # activations and runtime; None: activation_reserve()
    # Tensor parallelism: share of the link's bandwidth an all-reduce gets, and its fixed cost.
    link_utilization: float = 0.7
    allreduce_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        for name in ("mbu", "mfu", "gpu_memory_utilization", "link_utilization"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise PresetError(f"{name} must be in (0, 1], got {value}")
        for name in ("step_overhead_s", "seq_overhead_s"):
            if getattr(self, name) < 0:
                raise PresetError(f"{name} must be >= 0, got {getattr(self, name)}")


Row = tuple[int, int]  # (new tokens, tokens already in the cache)


def check_tp(shape: ModelShape, tp: int) -> None:
    """PresetError unless the shape splits over ``tp`` ranks as the engine splits it."""
    if tp < 1:
        raise PresetError(f"--tp must be >= 1, got {tp}")
    kv = shape.num_kv_heads
    if shape.num_heads % tp or shape.intermediate_size % tp or (kv % tp and tp % kv):
        raise PresetError(
            f"{shape.name} does not split over {tp} ranks: heads {shape.num_heads}, KV heads {kv} and "
            f"intermediate size {shape.intermediate_size} must divide by it (KV heads may be fewer)"
        )


def kv_bytes_per_token_per_rank(shape: ModelShape, tp: int) -> int:
    """A rank's KV bytes a token: its share of the KV heads, or one whole head when there are fewer
    KV heads than ranks (each is then replicated)."""
    return shape.kv_bytes_per_token * max(1, shape.num_kv_heads // tp) // shape.num_kv_heads


@dataclass(frozen=True)
class Roofline:
    gpu: Gpu
    shape: ModelShape
    assumptions: Assumptions = Assumptions()
    tp: int = 1  # tensor-parallel ranks (GPUs): each does 1/tp of the work, then all-reduces

    def breakdown(self, rows: Sequence[Row]) -> dict[str, float]:
        """Seconds of the step's two phases, each the max of its memory and compute time (at their
        efficiencies), the all-reduces (tensor parallelism), the overhead and the total."""
        s, a, tp = self.shape, self.assumptions, self.tp
        bandwidth, flops = self.gpu.hbm_bytes_per_s * a.mbu, self.gpu.bf16_flops * a.mfu
        tokens = sum(n for n, _ in rows)
        sum_context = sum(n + c for n, c in rows)
        pairs = sum(n * c + n * (n + 1) // 2 for n, c in rows)
        linear_flops = (2 * s.num_layers * s.layer_params * tokens + 2 * s.lm_head_params * len(rows)) / tp
        linear_memory = s.streamed_weight_bytes / tp / bandwidth
        attention_memory = (sum_context + tokens) * kv_bytes_per_token_per_rank(s, tp) / bandwidth
        attention_compute = s.attention_flops_per_pair * pairs / tp / flops
        linear = max(linear_memory, linear_flops / flops)
        attention = max(attention_memory, attention_compute)
        overhead = a.step_overhead_s + a.seq_overhead_s * len(rows)
        allreduce = 0.0
        if tp > 1:
            # Two all-reduces a layer (attention output, MLP down projection) and one for the
            # embedding, each of the step's hidden states; a ring moves 2 (tp - 1) / tp of them.
            count = 2 * s.num_layers + 1
            moved = 2 * (tp - 1) / tp * tokens * s.hidden_size * s.bytes_per_param
            link = self.gpu.link_bytes_per_s * a.link_utilization
            allreduce = count * (a.allreduce_latency_s + (moved / link if link else math.inf))
        return {
            "linear_s": linear,
            "attention_s": attention,
            "allreduce_s": allreduce,
            "memory_bound_s": linear_memory + attention_memory,
            "compute_bound_s": linear_flops / flops + attention_compute,
            "overhead_s": overhead,
            "seconds": linear + attention + allreduce + overhead,
        }

    def step_time(self, rows: Sequence[Row]) -> float:
        return self.breakdown(rows)["seconds"]

    def decode_time(self, num_seqs: int, context: int) -> float:
        """A decode step of ``num_seqs`` rows, each over ``context`` tokens (its new one included)."""
        return self.step_time([(1, context - 1)] * num_seqs)

    def prefill_time(self, tokens: int, computed: int = 0) -> float:
        return self.step_time([(tokens, computed)])

    def sample(self, rows: Sequence[Row]) -> StepSample:
        return StepSample(
            sum(n for n, _ in rows), len(rows), sum(n + c for n, c in rows), self.step_time(rows)
        )


def activation_reserve(shape: ModelShape, max_num_batched_tokens: int, max_num_seqs: int) -> float:
    """Memory kept from the KV cache: 1 GiB of runtime (CUDA context, cuBLAS workspace, allocator slack)
    plus the peak activations of a full-budget step (the MLP's gate/up and activated outputs and the
    residual stream in bf16, float32 logits for every row)."""
    per_token = (3 * shape.intermediate_size + 4 * shape.hidden_size) * shape.bytes_per_param
    return GIB + max_num_batched_tokens * per_token + max_num_seqs * shape.vocab_size * 4


@dataclass(frozen=True)
class EngineLimits:
    """The engine arguments a preset is sized for (the scheduler's bounds and the KV block size)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise PresetError(f"block_size must be a power of two, got {self.block_size}")
        if min(self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len) < 1:
            raise PresetError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise PresetError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs})"
            )


def kv_memory(
    gpu: Gpu, shape: ModelShape, settings: EngineLimits, assumptions: Assumptions, tp: int = 1
) -> dict[str, float]:
    """One GPU's HBM budget and the KV blocks left in it (with ``tp`` ranks: each rank's share of the
    weights and of the KV heads); PresetError when the weights do not fit or the cache cannot hold one
    request of max_model_len tokens."""
    budget = gpu.hbm_bytes * assumptions.gpu_memory_utilization
    reserve = assumptions.reserve_bytes
    if reserve is None:
        reserve = activation_reserve(shape, settings.max_num_batched_tokens, settings.max_num_seqs)
    weights = shape.weight_bytes / tp  # the norms, replicated, are a rounding error
    kv = budget - weights - reserve
    block_bytes = kv_bytes_per_token_per_rank(shape, tp) * settings.block_size
    where = f"one {gpu.name}" if tp == 1 else f"{tp} x {gpu.name} (per rank)"
    if kv < block_bytes:
        raise PresetError(
            f"{shape.name} does not fit on {where}: {weights / GB:.1f} GB of bf16 weights "
            f"+ {reserve / GB:.1f} GB reserved for activations leave {kv / GB:.1f} GB of the "
            f"{budget / GB:.1f} GB usable ({assumptions.gpu_memory_utilization:g} of "
            f"{gpu.hbm_bytes / GB:.0f} GB) for the KV cache"
        )
    num_blocks = math.floor(kv / block_bytes)
    if num_blocks * settings.block_size < settings.max_model_len:
        raise PresetError(
            f"{shape.name} on {where}: the KV cache holds {num_blocks * settings.block_size} tokens, "
            f"fewer than one request of max_model_len {settings.max_model_len}; lower --max-model-len"
        )
    return {
        "usable_bytes": budget,
        "weight_bytes": float(weights),
        "reserve_bytes": float(reserve),
        "kv_bytes": float(num_blocks * block_bytes),
        "num_blocks": float(num_blocks),
    }


def _grid_rows(settings: EngineLimits, kv_tokens: int) -> list[list[Row]]:
    """Batch shapes a server runs: decode batches of 1..max_num_seqs rows at contexts 128..max_model_len
    (as many as the KV cache holds), prefill chunks up to the token budget (a first chunk, and a later
    chunk of a long prompt), and decode batches with a prefill chunk filling the budget."""
    budget, max_len, max_seqs = settings.max_num_batched_tokens, settings.max_model_len, settings.max_num_seqs
    seq_counts = sorted({s for s in (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, max_seqs) if s <= max_seqs})
    contexts = sorted({c for c in (128, 256, 512, 1024, 2048, 4096, 8192, max_len) if c <= max_len})
    shapes: list[list[Row]] = []
    for s in seq_counts:
        for c in contexts:
            if s * c <= kv_tokens:
                shapes.append([(1, c - 1)] * s)
    chunks = sorted({p for p in (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, budget) if p <= budget})
    for p in chunks:
        if p <= max_len:
            shapes.append([(p, 0)])
        if 2 * p <= max_len and p >= 512:
            shapes.append([(p, p)])  # the second chunk of a prompt of 2p tokens
    for s in (s for s in (4, 16, 64, 128, max_seqs) if s <= max_seqs):
        for c in (512, 2048):
            for p in (256, 2048, budget - s):
                if 0 < p <= budget - s and p <= max_len and c <= max_len and s * c + p <= kv_tokens:
                    shapes.append([*([(1, c - 1)] * s), (p, 0)])
    return shapes


def grid_samples(roofline: Roofline, settings: EngineLimits, kv_tokens: int) -> list[StepSample]:
    return [roofline.sample(rows) for rows in _grid_rows(settings, kv_tokens)]


def build(
    gpu: str | Gpu,
    model: str | ModelShape,
    settings: EngineLimits = EngineLimits(),
    assumptions: Assumptions = Assumptions(),
    tp: int = 1,
) -> StepCostModel:
    """The cost model a roofline estimate gives; its ``host`` says it is an estimate and on what it rests.
    ``tp``: tensor parallelism over that many GPUs (memory figures are then per rank)."""
    g = gpu if isinstance(gpu, Gpu) else gpu_spec(gpu)
    shape = model if isinstance(model, ModelShape) else model_shape(model)
    check_tp(shape, tp)
    memory = kv_memory(g, shape, settings, assumptions, tp)
    num_blocks = int(memory["num_blocks"])
    roofline = Roofline(g, shape, assumptions, tp)
    samples = grid_samples(roofline, settings, num_blocks * settings.block_size)
    engine = {
        "model": shape.name,
        "dtype": "bfloat16",
        "attention_backend": "triton",
        "max_num_seqs": settings.max_num_seqs,
        "max_num_batched_tokens": settings.max_num_batched_tokens,
        "max_model_len": settings.max_model_len,
        "block_size": settings.block_size,
        "num_blocks": num_blocks,
        "kv_cache_dtype": shape.kv_cache_dtype,
        "enable_prefix_caching": False,
        "enable_chunked_prefill": True,
        "device": "cuda",
        "tensor_parallel_size": tp,
    }
    host = {
        "preset": g.name if tp == 1 else f"{tp}x {g.name}",
        "tensor_parallel_size": tp,
        "estimate": True,
        "source": "roofline estimate from vendor datasheet peaks (inflight/plan/presets.py), not measured",
        "gpu": asdict(g),
        "model_shape": asdict(shape),
        "params": shape.params,
        "weight_bytes": shape.weight_bytes,
        "kv_bytes_per_token": shape.kv_bytes_per_token,
        "assumptions": {**asdict(assumptions), "reserve_bytes": memory["reserve_bytes"]},
        "memory": memory,
    }
    cost = fit(samples, host=host, engine=engine)
    return replace(cost, fit={**cost.fit, **_errors_by_kind(cost, samples)})


def _kind(sample: StepSample) -> str:
    if sample.num_tokens == sample.num_seqs:
        return "decode"
    return "prefill" if sample.num_seqs == 1 else "mixed"


def _errors_by_kind(cost: StepCostModel, samples: Sequence[StepSample]) -> dict[str, float]:
    """rel_rms and rel_max of the linear model against the roofline for decode-only, lone prefill and
    mixed steps apart: where the linear form departs from the roofline's knees."""
    out: dict[str, float] = {}
    for kind in ("decode", "prefill", "mixed"):
        rel = [
            (cost.step_time(s.num_tokens, s.num_seqs, s.sum_context) - s.seconds) / s.seconds
            for s in samples
            if _kind(s) == kind
        ]
        if rel:
            out[f"{kind}_rel_rms"] = math.sqrt(sum(e * e for e in rel) / len(rel))
            out[f"{kind}_rel_max"] = max(abs(e) for e in rel)
    return out


def estimate_line(cost: StepCostModel) -> str | None:
    """The warning for a cost model that is a preset's estimate; None for a measured one."""
    if not cost.host.get("estimate"):
        return None
    return (
        f"ESTIMATE: roofline preset for {cost.host.get('preset', 'an unmeasured GPU')}, not measured; "
        "replace with `inflight plan calibrate` on the hardware"
    )


def reference_times(cost: StepCostModel) -> dict[str, float]:
    """The roofline's own step times (and the linear model's) for a few shapes, from a preset's host."""
    host = cost.host
    gpu = Gpu(**host["gpu"])
    shape = ModelShape(**host["model_shape"])
    tp = int(host.get("tensor_parallel_size", 1))
    roofline = Roofline(gpu, shape, replace(Assumptions(), **host["assumptions"]), tp)
    eng = cost.engine
    out: dict[str, float] = {}
    for seqs in sorted({1, 64, 256, eng["max_num_seqs"]}):
        if seqs <= eng["max_num_seqs"]:
            out[f"decode_{seqs}x1024_s"] = roofline.decode_time(seqs, min(1024, eng["max_model_len"]))
            out[f"decode_{seqs}x1024_model_s"] = cost.step_time(
                seqs, seqs, seqs * min(1024, eng["max_model_len"])
            )
    chunk = min(eng["max_num_batched_tokens"], eng["max_model_len"])
    out[f"prefill_{chunk}_s"] = roofline.prefill_time(chunk)
    out[f"prefill_{chunk}_model_s"] = cost.step_time(chunk, 1, chunk)
    return out
