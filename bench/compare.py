"""Do two targets produce the same tokens? Greedy outputs compared request by request.

Both runs must replay the same workload (same request ids, prompts and max_tokens). Greedy decoding
is deterministic per engine, but two engines sum in different orders, so a near-tie between the top
two logits can flip one token and everything after it: the count of identical requests is the
figure, and the first differing position says how far they agreed.
"""

from __future__ import annotations

from typing import Any

from bench.results import RunResult


def identical_outputs(a: RunResult, b: RunResult) -> dict[str, Any]:
    """``{"identical": n, "compared": N, "differing": {request_id: first differing index}}`` over the
    requests of ``a``; a request that recorded no tokens on either side counts as differing (index 0)."""
    theirs = {r.request_id: r.output_token_ids for r in b.requests}
    identical = 0
    differing: dict[str, int] = {}
    for r in a.requests:
        mine, other = r.output_token_ids, theirs.get(r.request_id, [])
        if mine and mine == other:
            identical += 1
            continue
        differing[r.request_id] = next(
            (i for i, (x, y) in enumerate(zip(mine, other, strict=False)) if x != y),
            min(len(mine), len(other)),
        )
    return {"identical": identical, "compared": len(a.requests), "differing": differing}


def describe_identical(result: dict[str, Any], a: str, b: str) -> str:
    """One line for the console: ``greedy outputs continuous vs vllm: identical 63/64 (...)``."""
    text = f"greedy outputs {a} vs {b}: identical {result['identical']}/{result['compared']}"
    if result["differing"]:
        first = sorted(result["differing"].items())[:4]
        text += " (first differing token: " + ", ".join(f"{rid} @{i}" for rid, i in first) + ")"
    return text


def peer_comparisons(runs: dict[str, RunResult], reference: str = "continuous") -> dict[str, dict[str, Any]]:
    """``identical_outputs(reference, peer)`` for each peer that records token ids (today: vllm)."""
    base = runs.get(reference)
    if base is None:
        return {}
    return {
        name: identical_outputs(base, run)
        for name, run in runs.items()
        if name in PEERS_WITH_TOKENS and any(r.output_token_ids for r in run.requests)
    }


# Targets outside this engine whose outputs are compared with it.
PEERS_WITH_TOKENS = ("vllm",)
