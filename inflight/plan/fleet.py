"""The simulator's inputs: the requests, the fleet and its service path, and the engine settings its
schedulers run with (those the cost model was measured with, overridden per run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.cost_model import StepCostModel
from inflight.plan.noise import SpeedTrace


@dataclass(frozen=True)
class SimRequest:
    arrival: float
    prompt_len: int
    output_len: int
    partition_key: int  # hashed to a partition (the real key is the session or prefix)
    priority: int = 0  # the priority policy's order (smaller first)


@dataclass(frozen=True)
class ServicePath:
    """The service path around each engine, in seconds; all 0 for an in-process engine (what
    calibrate times). Measured, not guessed: `python -m bench service` reports the intake ("gateway
    enqueue -> worker claim") and delivery stages, `inflight plan validate` the loop's time per step."""

    intake_s: float = 0.0  # at the gateway -> in its worker's fetch queue (produce, broker fetch wait)
    delivery_s: float = 0.0  # a token sampled -> at the client (Redis publish, SSE): adds to TTFT only
    step_overhead_s: float = 0.0  # the serving loop's time between two steps (outputs out, commands in)


@dataclass(frozen=True)
class FleetConfig:
    workers: int
    partitions: int | None = None  # None: one per worker
    max_pending: int | None = None  # gateway admission bound (None: unbounded)
    max_waiting: int | None = 16  # worker fetch bound: engine waiting queue
    engine: dict[str, Any] = field(default_factory=dict)  # overrides of the cost model's settings
    sample_workers: int | None = None  # simulate only workers 0..k-1 (see simulate())
    fast_path: bool = True  # apply runs of identical decode steps at once (off: step by step)
    service: ServicePath = ServicePath()
    # Workers start cold: each step of a token count its worker has not run (nor warmed up with, in
    # warm_shapes) pays cost.first_shape. Off by default: a long-running worker has seen them all,
    # unless it keeps only the shape_cache most recently run counts warm (an LRU, as oneDNN's
    # primitive cache is: 1,024 primitives, four linear shapes a token count -> 256; None: all).
    cold_shapes: bool = False
    warm_shapes: frozenset[int] = frozenset()
    shape_cache: int | None = None
    # Each step's time is the cost model's times a factor drawn from its measured variability
    # (noise_sigma, noise_phi; mean 1), seeded by this; None: every step exactly the model's.
    noise_seed: int | None = 0
    # Instead of drawn noise: worker w's steps take the model's time times speed[w] at the moment
    # they start (a run's measured speed over time, see noise.SpeedTrace).
    speed: tuple[SpeedTrace, ...] | None = None

    @property
    def num_partitions(self) -> int:
        return self.partitions or self.workers


def engine_config(cost: StepCostModel, overrides: dict[str, Any]) -> Any:
    """An EngineConfig for the scheduler alone, from the settings the cost model was measured with."""
    import torch

    from engine.config import EngineConfig, ModelConfig

    s = {**cost.engine, **overrides}
    model = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 32,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 1,
            "max_position_embeddings": int(s.get("max_model_len", 2048)),
        }
    )
    return EngineConfig(
        model_path="<simulated>",
        model=model,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=int(s.get("max_model_len", 2048)),
        max_num_seqs=int(s.get("max_num_seqs", 64)),
        max_num_batched_tokens=int(s.get("max_num_batched_tokens", 512)),
        block_size=int(s.get("block_size", 16)),
        # Trace prompts are random token ids: no prefix is ever shared, so the index would only cost time.
        enable_prefix_caching=False,
        enable_chunked_prefill=bool(s.get("enable_chunked_prefill", True)),
        scheduling_policy=str(s.get("scheduling_policy", "fcfs")),
        batching="continuous",
        attention_backend="torch",
        seed=0,
        load_format="dummy",
        max_waiting=None,
        enable_cuda_graph=False,
        num_blocks=int(s.get("num_blocks", 4096)),
        slo_ttft_s=s.get("slo_ttft_s"),
        slo_tpot_s=s.get("slo_tpot_s"),
        slo_reject=bool(s.get("slo_reject", False)),
        slo_starvation_s=float(s.get("slo_starvation_s", 30.0)),
        slo_tpot_headroom=float(s.get("slo_tpot_headroom", 0.1)),
        slo_speed_window_s=s.get("slo_speed_window_s", 1.0),
        slo_tpot_horizon=s.get("slo_tpot_horizon", 16),
    )
