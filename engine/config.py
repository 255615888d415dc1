"""Engine configuration: frozen dataclasses validated once, unknown keys rejected."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from engine.async_scheduling import decide_async_scheduling
from engine.inputs import ModelContext
from engine.platform.cpu import cpu_auto_dtype
from engine.quant.resolve import resolve_kv_cache_dtype, resolve_quantization

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class ModelConfig:
    """What the engine reads of an HF ``config.json``: the shape every family shares, then each
    family's choices (engine/models/registry.py reads them; docs/models.md lists them per family).
    A field a family does not support is refused when the config is read, never ignored."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (Qwen2; Llama's attention_bias also biases o_proj)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str | None
    sliding_window: int | None = None
    # ---- the family's choices (defaults: Llama's) ----
    hidden_act: str = "silu"  # silu | gelu_pytorch_tanh (gated MLP)
    norm_placement: str = "pre"  # pre | sandwich (Gemma) | post (OLMo 2): engine/models/decoder.py
    norm_offset: float = 0.0  # 1.0: Gemma's RMSNorm scales by 1 + w
    qk_norm: str | None = None  # head: RMSNorm per head (Qwen3, Gemma 3); full: over the projection (OLMo 2)
    embedding_scale: float | None = None  # Gemma: sqrt(hidden); Granite: embedding_multiplier
    residual_multiplier: float = 1.0  # Granite: each sublayer's output scaled before its residual add
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # Gemma 2: scores -> cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: the same on the logits
    logits_scaling: float = 1.0  # Granite: logits divided by it
    partial_rotary_factor: float = 1.0  # the fraction of each head that rotary turns
    # Per layer: the sliding window (None: full attention); empty: no layer has one.
    layer_windows: tuple[int | None, ...] = ()
    # Per layer: (rope_theta, rope_scaling), or None for a layer without rotary (SmolLM3's NoPE
    # layers); empty: every layer uses rope_theta and rope_scaling.
    layer_rope: tuple[tuple[float, dict[str, Any] | None] | None, ...] = ()
    # Mixture of experts (0 experts: dense).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # Qwen3-MoE's router rounds the chosen weights to the model dtype before the experts; Mixtral's
    # keeps them in float32. Bit-equal routing to HF in bf16 needs the same rounding.
    moe_weights_in_model_dtype: bool = False
    moe_layers: tuple[bool, ...] = ()  # per layer: sparse (True) or dense MLP

    def window_for_layer(self, i: int) -> int | None:
        return self.layer_windows[i] if self.layer_windows else None

    def rope_for_layer(self, i: int) -> tuple[float, dict[str, Any] | None] | None:
        return self.layer_rope[i] if self.layer_rope else (self.rope_theta, self.rope_scaling)

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]

    @property
    def kv_free_window(self) -> int | None:
        """The window, when every layer attends within the same one: KV blocks wholly before it can
        be freed (a family that mixes local and global layers keeps every block)."""
        windows = set(self.layer_windows)
        if len(windows) == 1 and None not in windows and len(self.layer_windows) == self.num_hidden_layers:
            return next(iter(windows))
        return None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        from engine.models.registry import family_for

        archs = raw.get("architectures") or []
        family, arch = family_for(archs, raw.get("model_type"))
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        context = ModelContext.from_config(raw)  # the context's bounds: one rule, shared with the gateway
        rope_theta = raw.get("rope_theta")
        # transformers >= 5 folds rope_theta into rope_parameters.
        rope_params = raw.get("rope_parameters")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
        common: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw.get("intermediate_size") or 0),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=num_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            max_position_embeddings=context.max_position_embeddings,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=context.rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
            sliding_window=context.sliding_window,
        )
        common.update(family.parse(raw, common))
        return cls(**common)

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        # A .gguf file's config comes from its metadata (engine/models/gguf.py); its weights are read
        # from the file itself or from the float copy, as EngineArgs.quantization says.
        from engine.models.gguf import local_tokenizer_files

        cfg = local_tokenizer_files(path) / "config.json"
        if not cfg.is_file():
            raise FileNotFoundError(f"no model at {path!s}: {cfg.name} not found")
        return cls.from_dict(json.loads(cfg.read_text()))


@dataclass(frozen=True)
class EngineArgs:
    """What a user may set, by the names vLLM uses. ``EngineArgs(**kwargs)`` rejects unknown names.

    The comment on each field is its entry in docs/configuration.md (``python -m inflight.reference``).
    """

    model: str
    # auto: bfloat16 on a GPU (float16 checkpoints stay float16), on a CPU what the CPU multiplies
    # fastest (INFLIGHT_CPU_AUTO_DTYPE); or float32, bfloat16, float16.
    dtype: str = "auto"
    max_model_len: int | None = None  # Longest prompt plus output, in tokens; None: the model's own.
    max_num_seqs: int = 64  # Requests in one step's batch.
    # The step's token budget: decodes take one token each, prompts are chunked to fit what is left.
    # None: 2048 with chunked prefill (short steps keep decodes fast), else max_model_len.
    max_num_batched_tokens: int | None = None
    block_size: int = 16  # Tokens per KV-cache block (a power of two); prefix caching shares whole blocks.
    # KV-cache blocks; None: sized from kv_cache_memory, else from free memory (up to 90% of a GPU; on a
    # CPU what max_num_seqs full-length requests need, at most 2 GiB).
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes for K/V across all layers
    enable_prefix_caching: bool = True  # Requests sharing a prompt prefix reuse its computed KV blocks.
    # Split long prompts over steps so that running requests keep decoding; off, a prompt must fit
    # max_num_batched_tokens whole.
    enable_chunked_prefill: bool = True
    # fcfs: by arrival; priority: lower `priority` first, then arrival (an urgent request may preempt a
    # less urgent one); slo: by deadline (below).
    scheduling_policy: Literal["fcfs", "priority", "slo"] = "fcfs"
    # slo policy (engine/sched/slo.py): a request's time-to-first-token deadline in seconds when it sets
    # none (per request: the slo_ttft_ms extra field); None: no default.
    slo_ttft_s: float | None = None
    # slo policy: the default deadline for the mean time per output token, in seconds (slo_tpot_ms).
    slo_tpot_s: float | None = None
    # slo policy: fail a request that would miss its TTFT deadline even with steps faster than modelled
    # (HTTP 503, code slo_ttft_unmet), so it stops taking capacity that others can still use.
    slo_reject: bool = False
    slo_starvation_s: float = 30.0  # slo policy: a request waiting this long is served by arrival.
    # Share of the TPOT deadline a step is not planned into: steps vary around the cost model (about
    # 20-30% on a CPU host), and a request whose every step is planned at its TPOT exactly misses it
    # half the time. Small, because TPOT is a mean and the step cap spreads a stream's slack (a fast
    # step gives back what a slow one took): simulated with the measured noise, 0.1 gave 1-10% more
    # goodput than 0.2 in five of the policy grid's six cells (2% less in one), and at 0.2 the real
    # benchmark's TPOT P99 sat at 0.81x the SLO.
    slo_tpot_headroom: float = 0.1
    # slo policy: the step-cost model (COST.json from `inflight plan calibrate`) that estimates prefill
    # and step times.
    slo_cost_model: str | None = None
    # The policy plans with the cost model scaled by the host's speed as served steps measure it, a
    # moving level over this many seconds (engine/sched/host_speed.py); None plans with the
    # calibrated model as it is. Measured only when steps run one at a time (async scheduling off).
    slo_speed_window_s: float | None = 1.0
    # A streaming request may absorb a long step now if the next this-many tokens, at the recent step
    # time, bring it back on course for its TPOT (engine/sched/slo.py step_time_cap); None spreads
    # its slack evenly over all the tokens it has left.
    slo_tpot_horizon: int | None = 16
    # continuous: requests join and leave at every step; static: a batch runs until its longest request
    # ends (the baseline the benchmarks compare against).
    batching: Literal["continuous", "static"] = "continuous"
    # auto: triton on a GPU; on a CPU the C++ kernels where they build, else torch (the reference path).
    attention_backend: Literal["auto", "cpu", "torch", "triton"] = "auto"
    seed: int = 0  # Seeds dummy weights and the seeds drawn for requests that set none.
    device: str = "auto"  # auto: cuda when available, else cpu; or a torch device name.
    load_format: Literal["auto", "dummy"] = "auto"  # dummy: random weights from config.json only
    # auto: a .gguf file's linear layers and embedding stay in its block formats (Q8_0, Q4_0, Q4_1,
    # Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), an HF checkpoint is read as stored (compressed-tensors: int8 or fp8
    # weights with per-channel scales; other quantization schemes refused); gguf / compressed-tensors:
    # the same, refused for any other kind of checkpoint; fp8: a float HF checkpoint's decoder linears
    # quantized at load to fp8 e4m3 with one scale per output channel (engine/quant/channel.py; the
    # embedding, LM head and MoE experts stay in dtype); none: every weight dequantised to dtype (a
    # GGUF's float copy in the model cache).
    quantization: Literal["auto", "gguf", "compressed-tensors", "fp8", "none"] = "auto"
    # auto: K/V cached in dtype; int8 or fp8_e4m3: one byte per value plus a float32 scale per token and
    # kv head (engine/kernels/kv_quant.py), a quarter of float32's bytes or about half of bf16's, so
    # about twice the tokens in the same memory (fp8_e4m3 on GPUs needs compute capability 8.9+).
    kv_cache_dtype: Literal["auto", "int8", "fp8_e4m3"] = "auto"
    # Requests the waiting queue may hold; one more raises EngineQueueFull. None: unbounded (a worker
    # bounds what it fetches instead, INFLIGHT_FETCH_MAX_WAITING, and leaves this unset).
    max_waiting: int | None = None
    enable_cuda_graph: bool = True  # GPU: replay CUDA graphs captured for decode-only steps.
    # Plan step N+1 while step N runs (vLLM's async scheduling); None = decide from the host, see
    # engine/async_scheduling.py. Off is the plain synchronous step.
    async_scheduling: bool | None = None
    # Ranks the model is split over (Megatron-style; NCCL on GPUs, one GPU per rank; gloo on a CPU).
    # One scheduler, KV manager and sampler; each rank holds 1/N of the heads and the MLP.
    tensor_parallel_size: int = 1
    # Seconds one grammar (a response_format schema, a regex, an EBNF grammar) may take to compile: the
    # compile runs in a child process that is killed past it, so a pathological schema stops using CPU
    # and its request fails (400); None: compile in process, unbounded. Most schemas compile in
    # milliseconds; some of a few kilobytes take minutes.
    grammar_compile_timeout_s: float | None = 30.0

    def __post_init__(self) -> None:
        if self.grammar_compile_timeout_s is not None and self.grammar_compile_timeout_s <= 0:
            raise ValueError("grammar_compile_timeout_s must be positive (or None: unbounded)")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        if self.scheduling_policy not in ("fcfs", "priority", "slo"):
            raise ValueError(
                f"scheduling_policy must be 'fcfs', 'priority' or 'slo', got {self.scheduling_policy!r}"
            )
        for name in ("slo_ttft_s", "slo_tpot_s", "slo_starvation_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.slo_tpot_horizon is not None and self.slo_tpot_horizon < 1:
            raise ValueError(f"slo_tpot_horizon must be >= 1 or None, got {self.slo_tpot_horizon}")
        if self.slo_speed_window_s is not None and not self.slo_speed_window_s > 0:
            raise ValueError(f"slo_speed_window_s must be > 0 or None, got {self.slo_speed_window_s}")
        if not 0.0 <= self.slo_tpot_headroom < 1.0:
            raise ValueError(f"slo_tpot_headroom must be in [0, 1), got {self.slo_tpot_headroom}")
        if self.batching not in ("continuous", "static"):
            raise ValueError(f"batching must be 'continuous' or 'static', got {self.batching!r}")
        if self.attention_backend not in ("auto", "cpu", "torch", "triton"):
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; use auto, float32, bfloat16 or float16")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        if self.quantization not in ("auto", "gguf", "compressed-tensors", "fp8", "none"):
            raise ValueError(
                f"unsupported quantization {self.quantization!r}; inflight serves auto, gguf (a .gguf file's "
                "block formats kept), compressed-tensors (int8 or fp8 weights kept), fp8 (a float "
                "checkpoint's linears quantized at load) and none"
            )
        if self.kv_cache_dtype not in ("auto", "int8", "fp8_e4m3"):
            raise ValueError(
                f"unsupported kv_cache_dtype {self.kv_cache_dtype!r}; use auto, int8 or fp8_e4m3"
            )
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}")
        return cls(model=model, **kwargs)


@dataclass(frozen=True)
class EngineConfig:
    """EngineArgs resolved against the model and the host: every field concrete."""

    model_path: str
    model: ModelConfig
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    enable_prefix_caching: bool
    enable_chunked_prefill: bool
    scheduling_policy: str
    batching: str
    attention_backend: str
    seed: int
    load_format: str
    max_waiting: int | None
    enable_cuda_graph: bool
    num_blocks: int | None = None  # None: sized from kv_cache_memory or free memory by the runner
    kv_cache_memory: int | None = None
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    slo_reject: bool = False
    slo_starvation_s: float = 30.0
    slo_tpot_headroom: float = 0.1
    slo_cost_model: str | None = None
    slo_speed_window_s: float | None = 1.0
    slo_tpot_horizon: int | None = 16
    async_scheduling: bool = False
    async_scheduling_reason: str = "default"  # why it is on or off, for the engine's start-up log
    tensor_parallel_size: int = 1
    # "gguf": the linear layers multiply the GGUF file's blocks as stored; "compressed-tensors": a
    # checkpoint's int8 or fp8 weights kept; "fp8": float weights quantized at load; None: float weights.
    quantization: str | None = None
    grammar_compile_timeout_s: float | None = None  # EngineArgs'; None: in process, unbounded
    # The KV cache's storage dtype: dtype itself, or torch.int8 / torch.float8_e4m3fn for the 8-bit
    # formats (engine/kernels/kv_quant.py).
    kv_cache_dtype: torch.dtype = torch.float32

    def with_device(self, device: torch.device) -> EngineConfig:
        """This config on another device (a tensor-parallel rank's own GPU)."""
        return dataclasses.replace(self, device=device)

    @classmethod
    def resolve(cls, args: EngineArgs) -> EngineConfig:
        model = ModelConfig.from_path(args.model)
        if args.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(args.device)
        if args.dtype == "auto":
            # CPUs without bf16 units run bf16 matmuls hundreds of times slower than fp32: ask the CPU.
            if device.type == "cpu":
                dtype = cpu_auto_dtype()
            else:
                dtype = _DTYPES.get(str(model.torch_dtype), torch.bfloat16)
                if dtype == torch.float32:
                    dtype = torch.bfloat16
        else:
            dtype = _DTYPES[args.dtype]
        context = ModelContext(model.max_position_embeddings, model.sliding_window, model.rope_scaling)
        max_model_len = context.max_model_len(args.max_model_len)
        if args.max_num_batched_tokens is not None:
            budget = args.max_num_batched_tokens
        else:
            # With chunking a modest budget keeps decodes fast; without it a whole prompt must fit.
            budget = 2048 if args.enable_chunked_prefill else max_model_len
        if args.max_num_batched_tokens is None:
            budget = max(budget, args.max_num_seqs)
        elif budget < args.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({budget}) must be >= max_num_seqs ({args.max_num_seqs}): "
                "every running sequence needs a token of budget to decode"
            )
        if not args.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                "without chunked prefill max_num_batched_tokens must be >= max_model_len "
                f"({budget} < {max_model_len})"
            )
        attn = args.attention_backend
        if attn == "auto":
            if device.type == "cuda":
                attn = "triton"
            else:
                # The C++ kernels when this host could build them (one warning if not), else torch.
                from engine.kernels import cpu as cpu_kernels

                attn = "cpu" if cpu_kernels.load() else "torch"
        overlap, overlap_reason = decide_async_scheduling(args.async_scheduling, device)
        if args.tensor_parallel_size > 1:
            from engine.distributed.sharding import check_divisible

            check_divisible(model, args.tensor_parallel_size)
            if device.type == "cuda" and torch.cuda.device_count() < args.tensor_parallel_size:
                raise ValueError(
                    f"tensor_parallel_size {args.tensor_parallel_size} needs as many GPUs; "
                    f"{torch.cuda.device_count()} visible"
                )
        return cls(
            model_path=args.model,
            model=model,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=budget,
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_chunked_prefill=args.enable_chunked_prefill,
            scheduling_policy=args.scheduling_policy,
            batching=args.batching,
            attention_backend=attn,
            seed=args.seed,
            load_format=args.load_format,
            max_waiting=args.max_waiting,
            enable_cuda_graph=args.enable_cuda_graph and device.type == "cuda",
            num_blocks=args.num_blocks,
            kv_cache_memory=args.kv_cache_memory,
            slo_ttft_s=args.slo_ttft_s,
            slo_tpot_s=args.slo_tpot_s,
            slo_reject=args.slo_reject,
            slo_starvation_s=args.slo_starvation_s,
            slo_tpot_headroom=args.slo_tpot_headroom,
            slo_cost_model=args.slo_cost_model,
            slo_speed_window_s=args.slo_speed_window_s,
            slo_tpot_horizon=args.slo_tpot_horizon,
            async_scheduling=overlap,
            async_scheduling_reason=overlap_reason,
            tensor_parallel_size=args.tensor_parallel_size,
            quantization=resolve_quantization(args),
            grammar_compile_timeout_s=args.grammar_compile_timeout_s,
            kv_cache_dtype=resolve_kv_cache_dtype(args.kv_cache_dtype, dtype, model.head_dim, attn, device),
        )
