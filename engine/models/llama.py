"""The Llama family (Llama 2/3, Mistral, Qwen2) over packed, variable-length batches.

Every tensor here is flat over the step's tokens ([T, ...]); requests are told apart only by the
attention metadata, so the linear layers batch across requests while attention reads each
request's own history through its block table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.models import cpu_gemm, onednn
from engine.models.rotary import apply_rotary, cos_sin_cache

_CPU_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# What fills the rows a step is padded with (ModelOps.row_padding): any valid id and position; no
# real row reads them.
PAD_TOKEN_ID = 0
PAD_POSITION = 0
_LINEARS = {  # layer dict key -> weight name under model.layers.{i}.
    "qkv": "self_attn.qkv_proj.weight",
    "o": "self_attn.o_proj.weight",
    "gate_up": "mlp.gate_up_proj.weight",
    "down": "mlp.down_proj.weight",
}


@dataclass
class ModelOps:
    """Pointwise ops, swappable for fused Triton kernels on CUDA or fused C++ kernels on CPU
    (engine/kernels/cpu; float32 and bfloat16, torch ops otherwise)."""

    use_triton: bool = False
    use_cpu_kernels: bool = False
    # On CPU, who multiplies the linear layers (engine/models/cpu_gemm.py): the engine's own kernels on
    # column-panel weights ("inflight"), oneDNN's packed weights ("onednn"), or torch's matmul.
    gemm: cpu_gemm.Gemm = "torch"
    # oneDNN's packing (the engine's choice, or where its own kernels cannot take a weight): 0 = off;
    # else the batch size it targets. In bf16 a decode step's small GEMMs otherwise repack every
    # weight on every call: 1.4-1.6x slower at 16-64 rows, measured on SmolLM2's shapes.
    prepack_rows: int = 0
    # With oneDNN's packed weights, a step's row count is rounded up to whole GEMM tiles (engine/models/
    # onednn.py) up to this many rows (the token budget); None: not padded.
    row_padding: onednn.RowPadding | None = None

    @property
    def packed(self) -> bool:
        return self.gemm == "inflight" or self.prepack_rows > 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        if self.gemm == "inflight" and cpu_gemm.packable(weight):
            return cpu_gemm.pack(weight)
        if not self.prepack_rows:
            return weight
        return onednn.pack(weight, self.prepack_rows)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dim() == 3:  # column panels (cpu_gemm.pack)
            return cpu_gemm.linear(x, weight, bias)
        if self.prepack_rows:
            return onednn.linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def padded_rows(self, n: int) -> int:
        return n if self.row_padding is None else self.row_padding.padded(n)

    def _cpu(self, x: torch.Tensor) -> bool:
        return self.use_cpu_kernels and x.dtype in _CPU_KERNEL_DTYPES

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self._cpu(x):
            out = torch.empty_like(x)
            torch.ops.inflight_cpu.rms_norm(out, x, None, weight, eps)
            return out
        if self.use_triton:
            from engine.kernels import rms_norm

            return rms_norm(x, weight, eps)
        # As HF: normalise in float32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cpu(x):
            # In place: residual becomes x + residual, x its norm (both are this step's temporaries).
            torch.ops.inflight_cpu.rms_norm(x, x, residual, weight, eps)
            return x, residual
        if self.use_triton:
            from engine.kernels import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, weight, eps)
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rotary(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cpu(q):
            # In place, on the strided views of the fused qkv projection: no copies.
            torch.ops.inflight_cpu.rotary(q, k, positions, cache)
            return q, k
        if self.use_triton:
            from engine.kernels import rotary_embedding

            # In place on the strided views of the fused qkv projection, as on the CPU: no copies.
            return rotary_embedding(positions, q, k, cache, inplace=True)
        return apply_rotary(positions, q, k, cache)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if self._cpu(x):
            out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
            torch.ops.inflight_cpu.silu_and_mul(out, x)
            return out
        if self.use_triton:
            from engine.kernels import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class LlamaForCausalLM:
    """Weights are plain tensors in a dict (loaded by engine.models.loader), merged for fewer
    matmuls: q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` per layer.

    Under tensor parallelism (``tp.size > 1``) the weights are this rank's shard
    (engine/distributed/sharding.py): the head counts below are the rank's own, the output and down
    projections end in an all-reduce, and the embedding and LM head cover a slice of the vocabulary.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        backend: AttentionBackend,
        ops: ModelOps,
        max_positions: int,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.config = config
        self.w = weights
        self.backend = backend
        self.ops = ops
        self._float_logits: torch.Tensor | None = None  # compute_logits' float32 output on CPU
        self.tp = tp
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp.size)
        # This rank's vocabulary rows [vocab_start, vocab_start + vocab_shard) (all of it at tp=1).
        self.vocab_shard = -(-config.vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_shard
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        device = weights["model.embed_tokens.weight"].device
        self.rope_cache = cos_sin_cache(
            self.head_dim, max_positions, config.rope_theta, config.rope_scaling
        ).to(device)
        self.layers = [self._layer_weights(i) for i in range(config.num_hidden_layers)]
        self.lm_head = ops.pack(weights.get("lm_head.weight", weights["model.embed_tokens.weight"]))
        if ops.packed:
            # The packed copies replace the originals (the embedding stays: lookups read it).
            for i, layer in enumerate(self.layers):
                for key, name in _LINEARS.items():
                    layer[key] = ops.pack(self.w.pop(f"model.layers.{i}.{name}"))
            self.w.pop("lm_head.weight", None)
            if ops.row_padding is not None:
                limit = ops.row_padding.limit
                # oneDNN's own (2-D) weights; column panels build nothing per row count.
                layer0 = [self.layers[0][k] for k in _LINEARS]
                packed = [(w, limit) for w in layer0 if w is not None and w.dim() == 2]
                heads = [(self.lm_head, ops.prepack_rows)] if self.lm_head.dim() == 2 else []
                onednn.warm_up([*packed, *heads], ops.row_padding)

    def _layer_weights(self, i: int) -> dict[str, torch.Tensor | None]:
        p = f"model.layers.{i}."
        return {
            "input_norm": self.w[p + "input_layernorm.weight"],
            "post_norm": self.w[p + "post_attention_layernorm.weight"],
            "qkv": self.w[p + "self_attn.qkv_proj.weight"],
            "qkv_bias": self.w.get(p + "self_attn.qkv_proj.bias"),
            "o": self.w[p + "self_attn.o_proj.weight"],
            "gate_up": self.w[p + "mlp.gate_up_proj.weight"],
            "down": self.w[p + "mlp.down_proj.weight"],
        }

    # ---- the forward, in segments --------------------------------------------------------------
    # forward() runs embed, then per layer pre_attention -> attention -> post_attention, then
    # final_norm. Everything but attention is token-wise, so the piecewise CUDA graphs
    # (engine/worker/piecewise_graph.py) capture those segments over padded rows and run attention
    # eagerly between them: both paths run these same functions.

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        num_tokens = input_ids.shape[0]
        padded = self.ops.padded_rows(num_tokens)
        if padded > num_tokens:
            # Rows past the real tokens only ride through the row-wise ops (norms, linears, MLP);
            # attention and the KV store see the real ones (attention()), and they are dropped below.
            input_ids = F.pad(input_ids, (0, padded - num_tokens), value=PAD_TOKEN_ID)
            positions = F.pad(positions, (0, padded - num_tokens), value=PAD_POSITION)
        hidden = self.embed(input_ids)
        residual: torch.Tensor | None = None
        assert len(kv_caches) == len(self.layers)
        for i, kv_cache in enumerate(kv_caches):
            qkv, residual = self.pre_attention(i, hidden, residual, positions)
            attn = self.attention(qkv, kv_cache, metadata)
            hidden, residual = self.post_attention(i, attn, residual)
        assert residual is not None
        return self.final_norm(hidden, residual)[:num_tokens]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        table = self.w["model.embed_tokens.weight"]
        if not self.tp.enabled:
            return F.embedding(input_ids, table)
        # Vocabulary-parallel: each rank looks up the ids in its slice, zeros for the others; the
        # all-reduce then leaves every row with exactly one rank's contribution.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_shard)
        hidden = F.embedding(local.masked_fill(outside, 0), table)
        hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(hidden)

    def pre_attention(
        self,
        i: int,
        hidden: torch.Tensor,  # [T, hidden]: the embedding (layer 0) or the previous layer's MLP output
        residual: torch.Tensor | None,  # [T, hidden]; None before layer 0
        positions: torch.Tensor,  # [T] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # qkv [T, q_size + 2 * kv_size] rotated, residual
        """Layer i's input norm, QKV projection and rotary."""
        layer = self.layers[i]
        assert layer["input_norm"] is not None and layer["qkv"] is not None
        eps = self.config.rms_norm_eps
        if residual is None:
            residual = hidden
            x = self.ops.rms_norm(hidden, layer["input_norm"], eps)
        else:
            x, residual = self.ops.add_rms_norm(hidden, residual, layer["input_norm"], eps)
        qkv = self.ops.linear(x, layer["qkv"], layer["qkv_bias"])
        q, k, _ = self._split_qkv(qkv)
        q_rot, k_rot = self.ops.rotary(positions, q, k, self.rope_cache)
        if q_rot is not q:
            # The torch op returns new tensors; the fused QKV row is what a step hands on.
            q.copy_(q_rot)
            k.copy_(k_rot)
        return qkv, residual

    def attention(
        self,
        qkv: torch.Tensor,  # [rows, q_size + 2 * kv_size] from pre_attention; rows >= num_tokens
        kv_cache: torch.Tensor,  # this layer's [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,  # [rows, q_size]: written in rows < num_tokens only
    ) -> torch.Tensor:  # [rows, q_size]
        """KV store and paged attention over the step's real tokens (metadata.num_tokens); rows past
        them (padding: ModelOps.row_padding, or a CUDA-graph bucket) are never stored, never attended,
        and come back zero, or as ``out`` held them (its owner keeps them harmless)."""
        rows, real = qkv.shape[0], metadata.num_tokens
        q, k, v = self._split_qkv(qkv[:real])
        if not (self.ops.use_cpu_kernels or self.ops.use_triton):
            # The torch path wants dense inputs; the C++ and Triton kernels read the strided views.
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # Store first: a request's own new tokens must be visible to its causal attention.
        self.backend.store_kv(k, v, kv_cache, metadata)
        attn = self.backend.forward(q, kv_cache, metadata, self.scale).reshape(real, self.q_size)
        if out is not None:
            out[:real].copy_(attn)
            return out
        if real < rows:
            attn = F.pad(attn, (0, 0, 0, rows - real))
        return attn

    def post_attention(
        self,
        i: int,
        attn: torch.Tensor,  # [T, q_size]
        residual: torch.Tensor,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the MLP's output [T, hidden], residual
        """Layer i's output projection, residual add and post-attention norm, and MLP."""
        layer = self.layers[i]
        assert layer["o"] is not None and layer["post_norm"] is not None
        x = self.tp.all_reduce(self.ops.linear(attn, layer["o"]))  # row-parallel: partial sums
        x, residual = self.ops.add_rms_norm(x, residual, layer["post_norm"], self.config.rms_norm_eps)
        return self._mlp(layer, x), residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        out, _ = self.ops.add_rms_norm(
            hidden, residual, self.w["model.norm.weight"], self.config.rms_norm_eps
        )
        return out

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q_size + 2 * kv_size] -> views q [T, Hq, D], k and v [T, Hkv, D]."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
        )

    def _mlp(self, layer: dict[str, torch.Tensor | None], x: torch.Tensor) -> torch.Tensor:
        assert layer["gate_up"] is not None and layer["down"] is not None
        down = self.ops.linear(self.ops.silu_and_mul(self.ops.linear(x, layer["gate_up"])), layer["down"])
        return self.tp.all_reduce(down)  # row-parallel: partial sums

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32. Tensor parallel: gathered from the vocabulary shards on
        rank 0 (where the sampler runs); the other ranks get their own shard's logits back, unused."""
        n = hidden.shape[0]
        padded = self.ops.padded_rows(n)
        if padded > n:
            hidden = F.pad(hidden, (0, 0, 0, padded - n))
        logits = self.ops.linear(hidden, self.lm_head)[:n]
        if self.tp.enabled:
            gathered = self.tp.gather_vocab(logits, self.config.vocab_size)
            logits = logits if gathered is None else gathered
        if logits.dtype == torch.float32 or logits.device.type != "cpu":
            return logits.float()
        # On CPU, into memory kept from step to step: a fresh [rows, vocab] float32 tensor is mapped
        # and page-faulted in anew each time (glibc returns blocks this large to the OS when freed),
        # which cost 6-12 ms of an ~80 ms bf16 decode step at 64 rows (SmolLM2, one thread) against
        # 0.5 ms into pages already mapped. The sampler reads the logits within the step and keeps
        # only tensors of its own, so the next step may overwrite them.
        n, vocab = logits.shape
        buf = self._float_logits
        if buf is None or buf.shape[0] < n or buf.shape[1] != vocab:
            buf = self._float_logits = torch.empty(max(n, self.ops.prepack_rows), vocab)
        return buf[:n].copy_(logits)
