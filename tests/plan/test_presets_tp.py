"""The GPU presets with tensor parallelism (--tp): weights and KV per rank, the per-layer all-reduces
at the link's bandwidth, and the estimate mark kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cost_model import StepCostModel
from inflight.cli import main
from inflight.plan import presets
from inflight.plan.presets import GPUS, MODELS, EngineLimits, PresetError, Roofline

H100, LLAMA = GPUS["h100"], MODELS["llama-3-8b"]


def test_a_model_too_big_for_one_gpu_fits_on_two() -> None:
    with pytest.raises(PresetError, match="does not fit on one h200"):
        presets.build("h200", "llama-3-70b")
    cost = presets.build("h200", "llama-3-70b", tp=2)
    memory = cost.host["memory"]
    assert memory["weight_bytes"] == pytest.approx(MODELS["llama-3-70b"].weight_bytes / 2)
    assert cost.host["estimate"] and cost.host["preset"] == "2x h200"
    assert cost.engine["tensor_parallel_size"] == 2


def test_each_rank_holds_its_share_of_the_kv_heads() -> None:
    one = presets.kv_memory(H100, LLAMA, EngineLimits(), presets.Assumptions())
    four = presets.kv_memory(H100, LLAMA, EngineLimits(), presets.Assumptions(), tp=4)
    # 8 KV heads over 4 ranks: a quarter of a token's KV per rank, and more HBM left for it.
    assert presets.kv_bytes_per_token_per_rank(LLAMA, 4) == LLAMA.kv_bytes_per_token // 4
    assert four["num_blocks"] > 4 * one["num_blocks"]
    # 8 KV heads over 16 ranks: each rank still holds one whole head (replicated).
    assert presets.kv_bytes_per_token_per_rank(LLAMA, 16) == LLAMA.kv_bytes_per_token // 8


def test_a_decode_step_splits_but_pays_the_all_reduces() -> None:
    rows = [(1, 1023)] * 64
    one = Roofline(H100, LLAMA).breakdown(rows)
    two = Roofline(H100, LLAMA, tp=2).breakdown(rows)
    assert one["allreduce_s"] == 0.0
    # 65 all-reduces of 64 x 4096 bf16 values, a ring moving half of them at 0.7 x 450 GB/s each way.
    moved = 0.5 * 2 * 64 * 4096 * 2
    assert two["allreduce_s"] == pytest.approx(65 * (10e-6 + moved / (0.7 * 450e9)))
    assert two["linear_s"] == pytest.approx(one["linear_s"] / 2)
    assert one["seconds"] / 2 < two["seconds"] < one["seconds"]


def test_shapes_that_do_not_split_are_refused() -> None:
    with pytest.raises(PresetError, match="does not split over 3 ranks"):
        presets.build("h100", "llama-3-8b", tp=3)


def test_cli_takes_tp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "tp.json"
    args = ["plan", "preset", "--gpu", "h100", "--model", "llama-3-70b", "--tp", "4", "--out", str(cost)]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("ESTIMATE: roofline preset for 4x h100") and "each of 4 ranks" in out
    assert StepCostModel.load(cost).host["tensor_parallel_size"] == 4
