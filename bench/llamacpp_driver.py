"""llama.cpp's side of ``python -m bench llamacpp``: run with ``.venv-llamacpp/bin/python`` (``make
bench-llamacpp`` builds it: llama-cpp-python compiled from source for this host).

This file runs inside that virtualenv, so it imports nothing of this project: only the standard library,
numpy and llama_cpp's C API bindings. One JSON object on stdin, one on stdout:

    {"op": "quantize", "source": GGUF, "target": GGUF, "ftype": "Q8_0" | "Q4_K_M" | ...}
        -> {"target": GGUF}                        llama_model_quantize (requantizing allowed)
    {"op": "perplexity", "model": GGUF, "threads": n, "token_ids": [...]}
        -> {"perplexity": p, "tokens": T}          one causal pass, logits at every position
    {"op": "speed", "model": GGUF, "threads": n, "prompt": [...], "new_tokens": G}
        -> {"prefill_tok_s", "decode_tok_s"}       batch 1, greedy, llama.cpp's own timers
    {"op": "burst", "model": GGUF, "threads": n, "prompts": [[...], ...], "new_tokens": G}
        -> {"wall_s", "output_tokens", "outputs"}  every prompt at once, one sequence a slot

The burst is what llama.cpp's server does with ``--parallel N`` slots: one context with N sequences,
and each step one ``llama_decode`` of a batch holding every running sequence's next token (prompts
enter in ``n_batch``-token pieces first). Greedy sampling is an argmax over the step's logits.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import time
from typing import Any

# Python puts this file's directory first on sys.path, where bench's own modules would shadow the
# standard library's or numpy's imports.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import llama_cpp as L  # noqa: E402
import numpy as np  # noqa: E402


def _silence() -> None:
    """llama.cpp logs to stderr by default; the bench reads only our JSON."""

    @L.llama_log_callback
    def quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        del level, text, user_data

    L.llama_log_set(quiet, ctypes.c_void_p())
    _silence.keep = quiet  # type: ignore[attr-defined]  # the callback must outlive this frame


class Model:
    def __init__(self, path: str, threads: int, n_ctx: int, n_seq: int, n_batch: int = 512) -> None:
        mp = L.llama_model_default_params()
        self.model = L.llama_model_load_from_file(path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.no_perf = False
        # A KV stream per sequence (n_ctx split evenly), as the server's slots each hold their own
        # context: attention then reads a sequence's own cells, not every cell of a shared pool.
        cp.kv_unified = False
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, n_seq)

    def close(self) -> None:
        L.llama_batch_free(self.batch)
        L.llama_free(self.ctx)
        L.llama_model_free(self.model)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        rc = L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def logits(self, rows: int) -> np.ndarray:
        """The last decode's logits rows (in batch order of the entries that asked for them)."""
        ptr = L.llama_get_logits(self.ctx)
        return np.ctypeslib.as_array(ptr, shape=(rows, self.n_vocab))

    def prefill(self, prompts: dict[int, list[int]], all_logits: bool = False) -> list[np.ndarray]:
        """Every sequence's prompt in n_batch pieces; the logits of each piece's flagged rows."""
        entries = [
            (t, pos, seq, all_logits or pos == len(ids) - 1)
            for seq, ids in prompts.items()
            for pos, t in enumerate(ids)
        ]
        out = []
        for start in range(0, len(entries), self.n_batch):
            piece = entries[start : start + self.n_batch]
            self.decode(piece)
            out.append(self.logits(sum(1 for e in piece if e[3])).copy())
        return out


def perplexity(spec: dict[str, Any]) -> dict[str, Any]:
    ids = spec["token_ids"]
    m = Model(spec["model"], spec["threads"], n_ctx=len(ids) + 16, n_seq=1, n_batch=len(ids))
    logits = np.concatenate(m.prefill({0: ids}, all_logits=True)).astype(np.float64)
    m.close()
    logits = logits[:-1]
    top = logits.max(axis=1, keepdims=True)
    logz = np.log(np.exp(logits - top).sum(axis=1)) + top[:, 0]
    nll = logz - logits[np.arange(len(ids) - 1), ids[1:]]
    return {"perplexity": float(np.exp(nll.mean())), "tokens": len(ids)}


def speed(spec: dict[str, Any]) -> dict[str, Any]:
    prompt, new = spec["prompt"], spec["new_tokens"]
    m = Model(spec["model"], spec["threads"], n_ctx=len(prompt) + new + 16, n_seq=1)
    best: dict[str, float] = {}
    for _ in range(spec.get("repeats", 2)):
        L.llama_memory_clear(L.llama_get_memory(m.ctx), True)
        L.llama_perf_context_reset(m.ctx)
        token = int(m.prefill({0: prompt})[-1][-1].argmax())
        for i in range(new - 1):
            m.decode([(token, len(prompt) + i, 0, True)])
            token = int(m.logits(1)[0].argmax())
        perf = L.llama_perf_context(m.ctx)
        prefill = perf.n_p_eval / (perf.t_p_eval_ms / 1e3)
        decode = perf.n_eval / (perf.t_eval_ms / 1e3)
        best["prefill_tok_s"] = max(best.get("prefill_tok_s", 0.0), prefill)
        best["decode_tok_s"] = max(best.get("decode_tok_s", 0.0), decode)
    m.close()
    return best


def burst(spec: dict[str, Any]) -> dict[str, Any]:
    prompts: list[list[int]] = spec["prompts"]
    new = spec["new_tokens"]
    n = len(prompts)
    m = Model(spec["model"], spec["threads"], n_ctx=sum(len(p) + new for p in prompts) + 16 * n, n_seq=n)
    start = time.perf_counter()
    # Each sequence's last prompt row is flagged, in sequence order: their logits come back in that order.
    rows = np.concatenate(m.prefill(dict(enumerate(prompts))))
    tokens = [int(t) for t in rows.argmax(axis=1)]
    outputs = [[t] for t in tokens]
    for step in range(new - 1):
        m.decode([(tokens[s], len(prompts[s]) + step, s, True) for s in range(n)])
        tokens = [int(t) for t in m.logits(n).argmax(axis=1)]
        for s in range(n):
            outputs[s].append(tokens[s])
    wall = time.perf_counter() - start
    m.close()
    return {"wall_s": wall, "output_tokens": n * new, "outputs": outputs}


def quantize(spec: dict[str, Any]) -> dict[str, Any]:
    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{spec['ftype']}")
    params.allow_requantize = True
    params.nthread = spec.get("threads", 1)
    rc = L.llama_model_quantize(spec["source"].encode(), spec["target"].encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize returned {rc}")
    return {"target": spec["target"]}


def main() -> int:
    spec = json.loads(sys.stdin.read())
    L.llama_backend_init()
    if not spec.get("verbose"):
        _silence()
    ops = {"perplexity": perplexity, "speed": speed, "burst": burst, "quantize": quantize}
    result = ops[spec["op"]](spec)
    result["system_info"] = L.llama_print_system_info().decode()
    result["llama_cpp_version"] = L.__version__
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
