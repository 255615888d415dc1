"""Benchmark targets: each replays a workload open-loop and returns a ``RunResult``.

    continuous   this engine, in process, iteration-level batching
    static       the same engine with batching="static" (a batch runs until its last request ends)
    hf-batch     HF transformers' own continuous batching (the manager behind ``generate_batch``)
    hf-generate  padded HF ``generate`` over static batches of the requests that have arrived
    vllm         vLLM's CPU backend from its own virtualenv (``make bench-peers``), driven in a child

Every target gets the same checkpoint, dtype, thread count, greedy sampling with EOS ignored, and
the same KV capacity in tokens, and is warmed up before it is measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from bench.results import RunResult
from inflight.plan.workload import RequestSpec

TARGETS = ("continuous", "static", "hf-batch", "hf-generate", "vllm")


@dataclass(frozen=True)
class TargetConfig:
    model: str
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_blocks: int | None = None  # None: room for max_num_seqs requests of max_model_len tokens
    max_model_len: int = 1024
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)  # extra engine args (engine targets)
    vllm_eager: bool = True  # vllm target: no torch.compile (the reference comparison ran eager)

    @property
    def kv_tokens(self) -> int:
        """KV capacity in tokens, the same for every target."""
        if self.num_blocks is not None:
            return self.num_blocks * self.block_size
        return self.max_num_seqs * self.max_model_len


class Target(Protocol):
    name: str

    def warmup(self, specs: list[RequestSpec]) -> None: ...
    def run(self, specs: list[RequestSpec], label: str, offered_rate: float) -> RunResult: ...
    def close(self) -> None: ...


def make_target(name: str, config: TargetConfig) -> Target:
    if name in ("continuous", "static"):
        from bench.targets.engine import EngineTarget

        return EngineTarget(name, config)
    if name == "hf-batch":
        from bench.targets.hf import HFBatchTarget

        return HFBatchTarget(config)
    if name == "hf-generate":
        from bench.targets.hf import HFGenerateTarget

        return HFGenerateTarget(config)
    if name == "vllm":
        from bench.targets.vllm_cpu import VLLMTarget

        return VLLMTarget(config)
    raise ValueError(f"unknown target {name!r}; choose from {', '.join(TARGETS)}")
