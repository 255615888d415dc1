"""Which slice of each checkpoint tensor a rank holds (Megatron-style sharding, every family).

    q/k/v, gate/up      column-parallel: output rows split; each rank computes its heads / its part
                        of the MLP's intermediate size with no communication
    o_proj, down_proj   row-parallel: input columns split; the partial products are summed by one
                        all-reduce each per layer
    embed, lm_head      vocabulary-parallel: rows split (the last shard zero-padded to equal size);
                        the embedding sums over ranks, the logits are gathered where the sampler runs
    experts             each expert split as a dense MLP (gate/up rows, down columns over
                        moe_intermediate_size); the router replicated
    norms, o bias       replicated (a row-parallel bias is added once, after the all-reduce)

KV heads split across ranks; with fewer KV heads than ranks each is replicated to the ranks whose
query heads read it. Example, 4 query heads, 2 KV heads (GQA group of 2):
    tp=2: rank 0 q heads [0, 1] kv head [0];  rank 1 q heads [2, 3] kv head [1]
    tp=4: rank r q head [r] kv head [r // 2]  (KV head 0 on ranks 0 and 1)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import ModelConfig

# (dim, start, stop): the rows (dim 0) or columns (dim 1) of a tensor a rank reads.
Region = tuple[int, int, int]


def check_divisible(config: ModelConfig, size: int) -> None:
    """Raise ValueError unless ``config`` splits over ``size`` ranks."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be at least 1, got {size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % size:
        raise ValueError(f"tensor_parallel_size {size} must divide num_attention_heads {heads}")
    if kv_heads % size and size % kv_heads:
        raise ValueError(
            f"tensor_parallel_size {size} must divide num_key_value_heads {kv_heads} or be a multiple of it"
        )
    if config.intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} must divide intermediate_size {config.intermediate_size}"
        )
    if config.num_experts and config.moe_intermediate_size % size:
        raise ValueError(
            f"tensor_parallel_size {size} must divide moe_intermediate_size {config.moe_intermediate_size}"
        )
    from engine.models.registry import family_of

    family = family_of(config.architecture)
    if size > 1 and not family.tensor_parallel:
        raise ValueError(f"{config.architecture} does not run tensor-parallel: {family.tp_refusal}")


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig
    rank: int
    size: int

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_key_value_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        kv = self.config.num_key_value_heads
        if kv >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv)  # replicated: the KV head this rank's query heads read

    @property
    def vocab_shard(self) -> int:  # rows per rank, the last shard padded up to it
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_shard

    def region(self, name: str) -> Region | None:
        """The slice of checkpoint tensor ``name`` this rank holds; None: the whole tensor."""
        c = self.config
        d = c.head_dim
        q = (0, self.rank * self.num_heads * d, (self.rank + 1) * self.num_heads * d)
        kv = (0, self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d)
        inter = c.intermediate_size // self.size
        mlp = (self.rank * inter, (self.rank + 1) * inter)
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return q
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return kv
        if name.endswith(("self_attn.v_proj.weight", "self_attn.v_proj.bias")):
            return kv
        if name.endswith("self_attn.o_proj.weight"):
            return (1, q[1], q[2])
        if name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
            return (0, *mlp)
        if name.endswith("mlp.down_proj.weight"):
            return (1, *mlp)
        if ".mlp.experts." in name:  # each expert split as a dense MLP, over moe_intermediate_size
            moe = c.moe_intermediate_size // self.size
            expert = (self.rank * moe, (self.rank + 1) * moe)
            return (1, *expert) if name.endswith("down_proj.weight") else (0, *expert)
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            start = min(self.vocab_start, c.vocab_size)
            return (0, start, min(start + self.vocab_shard, c.vocab_size))
        return None

    def take(self, name: str, read: Callable[[Region | None], torch.Tensor]) -> torch.Tensor:
        """``read(region)`` returns that slice of the tensor (only it read from disk); vocabulary
        shards come back padded to ``vocab_shard`` rows with zeros (their logits are cut off)."""
        region = self.region(name)
        tensor = read(region)
        if region is not None and name in ("model.embed_tokens.weight", "lm_head.weight"):
            missing = self.vocab_shard - tensor.shape[0]
            if missing:
                tensor = torch.cat([tensor, tensor.new_zeros(missing, *tensor.shape[1:])])
        return tensor


def slice_region(tensor: torch.Tensor, region: Region | None) -> torch.Tensor:
    """The in-memory counterpart of a sliced safetensors read (dummy weights)."""
    if region is None:
        return tensor
    dim, start, stop = region
    return tensor.narrow(dim, start, stop - start)
