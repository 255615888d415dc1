"""The start-up warm-up launches every Triton variant a step can pick (under the interpreter here:
what is checked is that every launch runs and that the list covers the launchers' choices)."""

from __future__ import annotations

import torch

from engine.kernels.paged_attention import SPLIT_CHOICES
from engine.kernels.warmup import warm_up


def test_warm_up_launches_every_variant(device):
    launched = warm_up(4, 2, 16, 16, torch.float32, 40, torch.device(device))
    assert [f"attention decode NUM_SPLITS={s}" for s in SPLIT_CHOICES] == launched[: len(SPLIT_CHOICES)]
    assert (
        "attention prefill max_query_len=2" in launched and "attention prefill max_query_len=128" in launched
    )
    assert sum(line.startswith("sampling ") for line in launched) == 8
    assert len(set(launched)) == len(launched)


def test_warm_up_launches_the_8bit_caches_variants(device):
    # An int8 cache compiles its own attention variants (codes and scales): they launch too.
    launched = warm_up(4, 2, 16, 16, torch.float32, 40, torch.device(device), kv_cache_dtype=torch.int8)
    assert "attention prefill max_query_len=128" in launched and len(launched) == len(set(launched))
