"""GPU cost-model presets: the roofline's figures, KV capacity from memory, the linear fit against the
roofline, the estimate mark surviving JSON, config.json shapes, and the CLI feeding ``plan size``."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from engine.cost_model import StepCostModel
from inflight.cli import main
from inflight.plan import presets
from inflight.plan.calibrate import describe
from inflight.plan.presets import GPUS, MODELS, Assumptions, EngineLimits, PresetError, Roofline

H200, LLAMA = GPUS["h200"], MODELS["llama-3-8b"]


@pytest.fixture(scope="module")
def h200_llama() -> StepCostModel:
    return presets.build("h200", "llama-3-8b")


def test_model_shapes_give_known_parameter_counts() -> None:
    assert LLAMA.params == pytest.approx(8.03e9, rel=0.02)  # Llama-3-8B: 8,030,261,248
    assert LLAMA.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 KV heads, bf16
    assert LLAMA.weight_bytes == 2 * LLAMA.params
    # An untied embedding table is gathered, not streamed: a step reads the rest.
    assert LLAMA.weight_bytes - LLAMA.streamed_weight_bytes == 2 * 128256 * 4096
    assert MODELS["llama-3-70b"].params == pytest.approx(70.6e9, rel=0.02)
    assert MODELS["qwen2.5-7b"].params == pytest.approx(7.62e9, rel=0.02)
    tied = MODELS["llama-3.2-1b"]  # tied: the table is the LM head, streamed every step
    assert tied.params == pytest.approx(1.24e9, rel=0.02) and tied.streamed_weight_bytes == tied.weight_bytes


def test_one_decode_reads_the_weights_at_the_assumed_bandwidth() -> None:
    a = Assumptions()
    roof = Roofline(H200, LLAMA, a)
    expected = LLAMA.streamed_weight_bytes / (4.8e12 * a.mbu) + a.step_overhead_s + a.seq_overhead_s
    assert roof.decode_time(1, 1024) == pytest.approx(expected, rel=0.03)
    assert roof.decode_time(1, 1024) == pytest.approx(5.45e-3, rel=0.01)  # the figure quoted in docs
    # Memory bound: the weights' read, not the 2 * 8e9 FLOPs, sets it; and more bandwidth is faster.
    parts = roof.breakdown([(1, 1023)])
    assert parts["memory_bound_s"] > 10 * parts["compute_bound_s"]
    assert Roofline(H200, LLAMA, Assumptions(mbu=0.9)).decode_time(1, 1024) < roof.decode_time(1, 1024)
    # A batch of 64 costs far less than 64 single decodes: the weights are read once for all.
    assert roof.decode_time(64, 1024) < 2 * roof.decode_time(1, 1024)


def test_a_big_prefill_is_compute_bound() -> None:
    a = Assumptions()
    roof = Roofline(H200, LLAMA, a)
    parts = roof.breakdown([(8192, 0)])
    assert parts["compute_bound_s"] > 10 * parts["memory_bound_s"]
    linear = 2 * (8192 * LLAMA.num_layers * LLAMA.layer_params + LLAMA.lm_head_params)
    attention = LLAMA.attention_flops_per_pair * 8192 * 8193 // 2
    assert parts["seconds"] == pytest.approx(
        (linear + attention) / (989e12 * a.mfu) + a.step_overhead_s + a.seq_overhead_s, rel=1e-9
    )
    # Time scales with tokens (a little more than linearly: causal attention is quadratic).
    small, big = (roof.prefill_time(n) - a.step_overhead_s for n in (2048, 8192))
    assert 4.0 < big / small < 4.6
    assert roof.prefill_time(8192) == pytest.approx(0.268, rel=0.01)


def test_an_8bit_kv_cache_holds_about_twice_the_blocks(h200_llama: StepCostModel) -> None:
    int8 = presets.build("h200", replace(LLAMA, kv_cache_dtype="int8"))
    # A byte a value plus a float32 scale per (token, KV head) row: 132 bytes a row against bf16's 256.
    assert replace(LLAMA, kv_cache_dtype="fp8_e4m3").kv_bytes_per_token == 2 * 32 * 8 * (128 + 4)
    assert int8.engine["kv_cache_dtype"] == "int8" and h200_llama.engine["kv_cache_dtype"] == "auto"
    assert int8.engine["num_blocks"] == pytest.approx(h200_llama.engine["num_blocks"] * 256 / 132, rel=1e-3)
    with pytest.raises(PresetError, match="unknown kv_cache_dtype"):
        _ = replace(LLAMA, kv_cache_dtype="fp4").kv_bytes_per_token


def test_kv_blocks_come_from_the_memory_left(h200_llama: StepCostModel) -> None:
    settings, a = EngineLimits(), Assumptions()
    reserve = presets.activation_reserve(LLAMA, settings.max_num_batched_tokens, settings.max_num_seqs)
    free = 141e9 * 0.9 - LLAMA.weight_bytes - reserve
    assert h200_llama.engine["num_blocks"] == math.floor(free / (LLAMA.kv_bytes_per_token * 16))
    assert 50_000 < h200_llama.engine["num_blocks"] < 53_000  # ~830k tokens of KV
    smaller = presets.build("h200", "llama-3-8b", assumptions=Assumptions(gpu_memory_utilization=0.5))
    assert smaller.engine["num_blocks"] < h200_llama.engine["num_blocks"] / 2
    a100 = presets.build("a100-80gb", "llama-3-8b")  # 80 GB: about half the KV room of 141 GB
    assert a100.engine["num_blocks"] < 0.6 * h200_llama.engine["num_blocks"]
    assert a.reserve_bytes is None and h200_llama.host["memory"]["reserve_bytes"] == reserve


def test_a_model_that_does_not_fit_is_refused() -> None:
    with pytest.raises(PresetError, match="llama-3-70b does not fit on one l4"):
        presets.build("l4", "llama-3-70b")
    # It fits, but a KV cache of ~25k tokens cannot hold one request of 64k.
    with pytest.raises(PresetError, match="lower --max-model-len"):
        presets.build("l4", "llama-3-8b", EngineLimits(max_num_seqs=8, max_model_len=65536))
    with pytest.raises(PresetError, match="unknown GPU"):
        presets.build("b200", "llama-3-8b")
    with pytest.raises(PresetError, match="mbu"):
        Assumptions(mbu=1.5)


def test_the_linear_fit_follows_the_roofline_within_its_reported_error(h200_llama: StepCostModel) -> None:
    cost = h200_llama
    roof = Roofline(H200, LLAMA)
    kv_tokens = cost.engine["num_blocks"] * cost.engine["block_size"]
    rows = presets._grid_rows(EngineLimits(), kv_tokens)
    assert len(rows) == cost.fit["num_samples"] > 50
    errors = []
    for r in rows:
        sample = roof.sample(r)
        truth = roof.step_time(r)
        errors.append(
            (cost.step_time(sample.num_tokens, sample.num_seqs, sample.sum_context) - truth) / truth
        )
    assert max(abs(e) for e in errors) <= cost.fit["rel_max"] + 1e-9
    assert math.sqrt(sum(e * e for e in errors) / len(errors)) == pytest.approx(cost.fit["rel_rms"], rel=1e-6)
    # How well a line follows a max (regression guards on the figures the docs quote).
    assert cost.fit["rel_rms"] < 0.2 and cost.fit["decode_rel_rms"] < 0.2
    assert cost.step_time(1, 1, 1024) == pytest.approx(roof.decode_time(1, 1024), rel=0.05)
    assert cost.noise_sigma == 0.0 and cost.first_shape == 0.0
    assert min(cost.fixed, cost.per_token, cost.per_context) > 0


def test_the_estimate_mark_survives_json(h200_llama: StepCostModel, tmp_path: Path) -> None:
    path = tmp_path / "h200.json"
    h200_llama.save(path)
    back = StepCostModel.load(path)
    assert back.host["estimate"] is True and back.host["preset"] == "h200"
    assert back.host["assumptions"]["mbu"] == 0.8 and back.host["gpu"]["hbm_bytes_per_s"] == 4.8e12
    assert back.engine == h200_llama.engine and back.engine["device"] == "cuda"
    assert back.step_time(64, 64, 65536) == h200_llama.step_time(64, 64, 65536)
    text = describe(back)
    assert text.startswith("ESTIMATE: roofline preset for h200, not measured")
    assert "relative RMS error" in text
    measured = StepCostModel(0.004, 5e-5, 1e-4, 2e-6, host={"cpu": "x"})
    assert "ESTIMATE" not in describe(measured) and presets.estimate_line(measured) is None


def test_a_checkpoints_config_json_gives_its_shape(tmp_path: Path) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    shape = presets.model_shape(str(tmp_path))
    assert (shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (4, 8, 2, 32)
    per_layer = 256 * 256 * 2 + 2 * 256 * 64 + 3 * 256 * 512 + 2 * 256
    assert shape.params == 4 * per_layer + 1000 * 256 + 256  # tied: one table
    assert shape.kv_bytes_per_token == 2 * 4 * 2 * 32 * 2
    cost = presets.build("l4", str(tmp_path), EngineLimits(max_num_seqs=16, max_model_len=1024))
    assert cost.engine["model"] == str(tmp_path) and cost.host["params"] == shape.params
    del config["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PresetError, match="vocab_size"):
        presets.model_shape(str(tmp_path))
    with pytest.raises(PresetError, match="unknown model"):
        presets.model_shape(str(tmp_path / "nowhere"))


def test_cli_preset_feeds_plan_size_and_warns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost = tmp_path / "h200.json"
    assert main(["plan", "preset", "--gpu", "h200", "--model", "llama-3-8b", "--out", str(cost)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ESTIMATE: roofline preset for h200") and "decode_256x1024" in out
    assert StepCostModel.load(cost).engine["max_num_seqs"] == 256
    args = ["plan", "size", "--rate", "150", "--slo", "ttft:500", "tpot:50", "--cost", str(cost)]
    assert main([*args, "--duration", "3", "--plot", str(tmp_path / "size.png")]) == 0
    captured = capsys.readouterr()
    assert "smallest fleet meeting ttft:500 tpot:50" in captured.out
    assert captured.err.count("\n") == 1 and captured.err.startswith("warning: ESTIMATE: roofline preset")
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"arrival": i * 0.01, "prompt_len": 200, "output_len": 20}) + "\n" for i in range(50)
        )
    )
    assert (
        main(["plan", "simulate", "--trace", str(trace), "--cost", str(cost), "--workers", "1", "--json"])
        == 0
    )
    captured = capsys.readouterr()
    assert json.loads(captured.out)["num_completed"] == 50 and "warning: ESTIMATE" in captured.err


def test_cli_preset_list_and_refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "preset", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in (*GPUS, *MODELS))
    out_path = tmp_path / "no.json"
    with pytest.raises(SystemExit, match="does not fit on one l4"):
        main(["plan", "preset", "--gpu", "l4", "--model", "llama-3-70b", "--out", str(out_path)])
    assert not out_path.exists()
