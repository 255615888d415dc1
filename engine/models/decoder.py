"""A decoder-only transformer composed of engine/layers, over packed, variable-length batches.

Every family (engine/models/registry.py) is this model with its own choices, read from its config
(ModelConfig): where the norms sit, q/k norms, the activation, rotary per layer, sliding windows and
soft caps, multipliers, and a dense or mixture-of-experts MLP. The norm placements:

    pre        x = norm(h); h += attn(x); x = norm(h); h += mlp(x)                 Llama and most
    sandwich   as pre, each sublayer's output normed again before it is added      Gemma 2 / 3
    post       h += norm(attn(h)); h += norm(mlp(h))                               OLMo 2

Every tensor here is flat over the step's tokens ([T, ...]); requests are told apart only by the
attention metadata, so the linear layers batch across requests while attention reads each request's
own history through its block table. Under tensor parallelism the weights are this rank's shard
(engine/distributed/sharding.py): head counts are the rank's own, row-parallel layers all-reduce, the
embedding and LM head cover a slice of the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig
from engine.distributed.parallel_state import SINGLE, TensorParallel
from engine.layers.activation import activation
from engine.layers.attention import Attention
from engine.layers.embedding import LMHead, VocabEmbedding
from engine.layers.kernels import CustomOp, Kernels
from engine.layers.linear import Linear, Weight
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.quant.channel import ChannelWeight
from engine.quant.stacked import StackedWeight
from engine.quant.weight import QuantizedWeight

# What fills the rows a step is padded with (Kernels.row_padding): any valid id and position; no
# real row reads them.
PAD_TOKEN_ID = 0
PAD_POSITION = 0


class DenseMLP:
    def __init__(self, gate_up: Linear, down: Linear, act: CustomOp) -> None:
        self.gate_up_proj = gate_up
        self.down_proj = down
        self.act = act

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


@dataclass
class DecoderLayer:
    input_norm: RMSNorm | None  # None: "post" placement (OLMo 2)
    qkv_proj: Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    rotary: RotaryEmbedding | None  # None: a layer without position encoding (SmolLM3's NoPE layers)
    attn: Attention
    o_proj: Linear
    attn_out_norm: RMSNorm | None
    mlp_norm: RMSNorm | None
    mlp: Callable[[torch.Tensor], torch.Tensor]  # DenseMLP or engine.layers.moe.FusedMoE
    mlp_out_norm: RMSNorm | None


class DecoderModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        backend: AttentionBackend,
        kernels: Kernels,
        max_positions: int,
        tp: TensorParallel = SINGLE,
    ) -> None:
        self.config = config
        self.backend = backend
        self.kernels = kernels
        self.tp = tp
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = max(1, config.num_key_value_heads // tp.size)
        # This rank's vocabulary rows [vocab_start, vocab_start + vocab_shard) (all of it at tp=1).
        self.vocab_shard = -(-config.vocab_size // tp.size)
        self.vocab_start = tp.rank * self.vocab_shard
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        embed = weights.pop("model.embed_tokens.weight")
        final_norm = weights.pop("model.norm.weight")
        # The model's dtype is its float weights' (the embedding may be a GGUF block format).
        self.device, self.dtype = final_norm.device, final_norm.dtype
        self.embed_tokens = VocabEmbedding(embed, tp, self.vocab_shard, self.dtype, config.embedding_scale)
        self._rotaries: dict[tuple[object, ...], RotaryEmbedding] = {}
        self._max_positions = max_positions
        self.layers = [self._layer(i, weights) for i in range(config.num_hidden_layers)]
        self.norm = RMSNorm(final_norm, config.rms_norm_eps, kernels, config.norm_offset)
        head = weights.pop("lm_head.weight", None)
        self.lm_head = LMHead(
            embed if head is None else head,
            kernels,
            tp,
            config.vocab_size,
            soft_cap=config.final_logit_softcap,
            scaling=config.logits_scaling,
        )
        if weights:
            raise KeyError(f"weights this model does not use: {sorted(weights)[:5]}")
        if kernels.row_padding is not None:
            from engine.models import onednn

            # oneDNN's own (2-D) weights; column panels build nothing per row count.
            limit = kernels.row_padding.limit
            layer0 = self.layers[0]
            linears = [layer0.qkv_proj, layer0.o_proj]
            if isinstance(layer0.mlp, DenseMLP):
                linears += [layer0.mlp.gate_up_proj, layer0.mlp.down_proj]
            dense = [lin.weight for lin in linears]
            packed = [(w, limit) for w in dense if isinstance(w, torch.Tensor) and w.dim() == 2]
            lm = self.lm_head.weight
            heads = [(lm, kernels.prepack_rows)] if isinstance(lm, torch.Tensor) and lm.dim() == 2 else []
            onednn.warm_up([*packed, *heads], kernels.row_padding)

    # ---- construction --------------------------------------------------------------------------
    def _norm(self, w: dict[str, torch.Tensor], name: str) -> RMSNorm | None:
        weight = w.pop(name, None)
        if weight is None:
            return None
        return RMSNorm(weight, self.config.rms_norm_eps, self.kernels, self.config.norm_offset)

    def _rotary(self, i: int) -> RotaryEmbedding | None:
        c = self.config
        rope = c.rope_for_layer(i)
        if rope is None:
            return None
        theta, scaling = rope
        rotary_dim = int(c.head_dim * c.partial_rotary_factor)
        key = (theta, repr(scaling), rotary_dim)
        if key not in self._rotaries:
            self._rotaries[key] = RotaryEmbedding(
                rotary_dim,
                self._max_positions,
                theta,
                scaling,
                c.max_position_embeddings,
                self.kernels,
                self.device,
            )
        return self._rotaries[key]

    def _layer(self, i: int, w: dict[str, torch.Tensor]) -> DecoderLayer:
        c, k, tp = self.config, self.kernels, self.tp
        p = f"model.layers.{i}."
        attention = Attention(
            self.backend,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            c.attention_scale if c.attention_scale is not None else self.head_dim**-0.5,
            sliding_window=c.window_for_layer(i),
            logits_soft_cap=c.attn_logit_softcap,
            dense_inputs=not (k.cpu or k.triton),
        )
        mlp: Callable[[torch.Tensor], torch.Tensor]
        if p + "mlp.experts.w13" in w:
            from engine.layers.moe import FusedMoE

            mlp = FusedMoE(
                w.pop(p + "mlp.gate.weight"),
                w.pop(p + "mlp.experts.w13"),
                w.pop(p + "mlp.experts.w2"),
                c.num_experts_per_tok,
                c.norm_topk_prob,
                c.hidden_act,
                k,
                tp,
                round_weights=c.moe_weights_in_model_dtype,
            )
        else:
            mlp = DenseMLP(
                Linear(w.pop(p + "mlp.gate_up_proj.weight"), k),
                Linear(w.pop(p + "mlp.down_proj.weight"), k, reduce=True, tp=tp),
                activation(c.hidden_act, k),
            )
        return DecoderLayer(
            input_norm=self._norm(w, p + "input_norm.weight"),
            qkv_proj=Linear(
                w.pop(p + "self_attn.qkv_proj.weight"), k, w.pop(p + "self_attn.qkv_proj.bias", None)
            ),
            q_norm=self._norm(w, p + "self_attn.q_norm.weight"),
            k_norm=self._norm(w, p + "self_attn.k_norm.weight"),
            rotary=self._rotary(i),
            attn=attention,
            o_proj=Linear(
                w.pop(p + "self_attn.o_proj.weight"),
                k,
                w.pop(p + "self_attn.o_proj.bias", None),
                reduce=True,
                tp=tp,
            ),
            attn_out_norm=self._norm(w, p + "attn_out_norm.weight"),
            mlp_norm=self._norm(w, p + "mlp_norm.weight"),
            mlp=mlp,
            mlp_out_norm=self._norm(w, p + "mlp_out_norm.weight"),
        )

    def linear_weights(self) -> list[tuple[Weight, torch.Tensor | None]]:
        """(weight, bias) of every dense linear layer in the order a step runs them (qkv, o, gate_up,
        down per layer, then the LM head), as the layers hold them (packed where the engine packs)."""
        out: list[tuple[Weight, torch.Tensor | None]] = []
        for layer in self.layers:
            out += [(layer.qkv_proj.weight, layer.qkv_proj.bias), (layer.o_proj.weight, layer.o_proj.bias)]
            if isinstance(layer.mlp, DenseMLP):
                out += [(layer.mlp.gate_up_proj.weight, None), (layer.mlp.down_proj.weight, None)]
        return [*out, (self.lm_head.weight, None)]

    def weight_bytes(self) -> dict[str, int]:
        """Bytes of the embedding table, of every dense linear layer (by index) and of the LM head
        when it is not the embedding table (tied)."""
        sizes = {"model.embed_tokens.weight": _nbytes(self.embed_tokens.table)}
        for i, (w, _) in enumerate(self.linear_weights()[:-1]):
            sizes[f"linear.{i}"] = _nbytes(w)
        if self.lm_head.weight is not self.embed_tokens.table:
            sizes["lm_head.weight"] = _nbytes(self.lm_head.weight)
        return sizes

    # ---- the forward, in segments --------------------------------------------------------------
    # forward() runs embed, then per layer pre_attention -> attention -> post_attention, then
    # final_norm. Everything but attention is token-wise, so the piecewise CUDA graphs
    # (engine/runner/piecewise_graph.py) capture those segments over padded rows and run attention
    # eagerly between them: both paths run these same functions. Between segments the stream travels
    # as (hidden, residual): the last sublayer's output, not yet added, and the sum of all before it.

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer, in the backend's layout
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden] after the final norm
        num_tokens = input_ids.shape[0]
        padded = self.kernels.padded_rows(num_tokens)
        if padded > num_tokens:
            # Rows past the real tokens only ride through the row-wise ops (norms, linears, MLP);
            # attention and the KV store see the real ones (Attention), and they are dropped below.
            input_ids = F.pad(input_ids, (0, padded - num_tokens), value=PAD_TOKEN_ID)
            positions = F.pad(positions, (0, padded - num_tokens), value=PAD_POSITION)
        hidden = self.embed(input_ids)
        residual: torch.Tensor | None = None
        assert len(kv_caches) == len(self.layers)
        for i, kv_cache in enumerate(kv_caches):
            qkv, residual = self.pre_attention(i, hidden, residual, positions)
            attn = self.attention(i, qkv, kv_cache, metadata)
            hidden, residual = self.post_attention(i, attn, residual)
        assert residual is not None
        return self.final_norm(hidden, residual)[:num_tokens]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.embed_tokens(input_ids)

    def pre_attention(
        self,
        i: int,
        hidden: torch.Tensor,  # [T, hidden]: the embedding (layer 0) or the previous layer's MLP output
        residual: torch.Tensor | None,  # [T, hidden]; None before layer 0
        positions: torch.Tensor,  # [T] int64
    ) -> tuple[torch.Tensor, torch.Tensor]:  # qkv [T, q_size + 2 * kv_size] rotated, residual
        """Layer i's input norm, QKV projection, q/k norms and rotary."""
        layer = self.layers[i]
        if residual is None:
            residual = hidden
            x = hidden if layer.input_norm is None else layer.input_norm(hidden)
        elif layer.input_norm is None:
            residual = hidden + residual
            x = residual
        else:
            x, residual = layer.input_norm.add(hidden, residual)
        qkv = layer.qkv_proj(x)
        q, k, _ = layer.attn.split(qkv)
        if layer.q_norm is not None and layer.k_norm is not None:
            if self.config.qk_norm == "full":  # OLMo 2: over the whole projection, not per head
                q.copy_(layer.q_norm(q.reshape(q.shape[0], -1)).view_as(q))
                k.copy_(layer.k_norm(k.reshape(k.shape[0], -1)).view_as(k))
            else:
                q.copy_(layer.q_norm(q))
                k.copy_(layer.k_norm(k))
        if layer.rotary is not None:
            layer.rotary(positions, q, k)
        return qkv, residual

    def attention(
        self,
        i: int,
        qkv: torch.Tensor,  # [rows, q_size + 2 * kv_size] from pre_attention; rows >= num_tokens
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,  # [rows, q_size]: written in rows < num_tokens only
    ) -> torch.Tensor:  # [rows, q_size]
        return self.layers[i].attn(qkv, kv_cache, metadata, out)

    def post_attention(
        self,
        i: int,
        attn: torch.Tensor,  # [T, q_size]
        residual: torch.Tensor,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # the MLP's output [T, hidden], residual
        """Layer i's output projection, its residual add, and the MLP."""
        layer = self.layers[i]
        multiplier = self.config.residual_multiplier
        h = layer.o_proj(attn)
        if layer.attn_out_norm is not None:
            h = layer.attn_out_norm(h)
        if multiplier != 1.0:
            h = h * multiplier
        if layer.mlp_norm is None:
            residual = h + residual
            x = residual
        else:
            x, residual = layer.mlp_norm.add(h, residual)
        out = layer.mlp(x)
        if layer.mlp_out_norm is not None:
            out = layer.mlp_out_norm(out)
        if multiplier != 1.0:
            out = out * multiplier
        return out, residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        out, _ = self.norm.add(hidden, residual)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32. Tensor parallel: gathered from the vocabulary shards on
        rank 0 (where the sampler runs); the other ranks get their own shard's logits back, unused."""
        return self.lm_head(hidden)


def _nbytes(t: Weight) -> int:
    if isinstance(t, QuantizedWeight | ChannelWeight | StackedWeight):
        return t.nbytes
    return t.numel() * t.element_size()
