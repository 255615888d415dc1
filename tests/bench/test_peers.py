"""``python -m bench peers`` on the tiny model without vLLM (every thread count of ``--threads`` gets its
rows and its probe), and the decode probe's linear baseline: the loaded model's own weights through its
own ops, at the rows the engine pads a step to."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import micro
from bench.cli import main
from bench.micro import MatmulProbe, ModelLinearsProbe
from bench.peers import parse_threads, table
from engine.layers.kernels import Kernels
from engine.llm_engine import LLMEngine
from engine.models import cpu_gemm, onednn


@pytest.fixture
def keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_parse_threads() -> None:
    assert parse_threads("1,2") == [1, 2]
    assert parse_threads("2, 1,2") == [2, 1]  # in order, once each
    for bad in ("0", "1,-1", "one", ""):
        with pytest.raises(SystemExit, match="--threads"):
            parse_threads(bad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_linear_baseline_runs_the_models_own_weights_and_ops(
    tiny_model: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine.from_engine_args(
        str(tiny_model), dtype=dtype, max_num_seqs=20, max_num_batched_tokens=64, max_model_len=128
    )
    model = engine.runner.model
    probe = ModelLinearsProbe(model, 20, engine.config.dtype)
    # Where oneDNN multiplies the packed weights, the engine pads a step's rows to whole GEMM tiles;
    # its own kernels (engine/models/cpu_gemm.py) and torch's take the rows as they are.
    pads = model.kernels.gemm == "onednn"
    assert pads == (model.kernels.row_padding is not None)
    grain = onednn.row_grain(engine.config.dtype)
    assert probe.padded_rows == (onednn.RowPadding(grain, 64).padded(20) if pads else 20)
    assert probe.padded_rows == model.kernels.padded_rows(20)
    # Every linear of every layer, then the LM head: the very tensors the model multiplies by.
    expected = [
        w
        for layer in model.layers
        for w in (
            layer.qkv_proj.weight,
            layer.o_proj.weight,
            layer.mlp.gate_up_proj.weight,
            layer.mlp.down_proj.weight,
        )
    ] + [model.lm_head.weight]
    assert all(w is e for (_, w, _), e in zip(probe.calls, expected, strict=True))
    assert all(
        x.shape == (probe.padded_rows, cpu_gemm.features(w)[1]) and x.dtype == engine.config.dtype
        for x, w, _ in probe.calls
    )
    # Useful FLOPs at the real rows, the same count as the raw probe's shapes.
    assert probe.flops == MatmulProbe(engine.config.model, 20).flops
    seen: list[tuple[int, ...]] = []
    real = micro.matmul

    def counting(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kernels: Kernels) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return real(x, w, b, kernels)

    monkeypatch.setattr(micro, "matmul", counting)
    assert probe.time_pass() > 0
    assert len(seen) == len(expected)


def test_peers_runs_every_thread_count(tiny_model: Path, tmp_path: Path, keep_threads: None) -> None:
    out = tmp_path / "peers"
    argv = ["peers", "--no-vllm", "--models", str(tiny_model), "--dtypes", "float32", "--threads", "1,2"]
    argv += ["--batches", "4:64", "--num-requests", "4", "--probe", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "peers.json").read_text())
    assert result["host"]["threads"] == [1, 2]
    assert [r["threads"] for r in result["rows"]] == [1, 2]
    assert all(r["inflight_tok_s"] > 0 and "vllm_tok_s" not in r for r in result["rows"])
    assert [(p["threads"], p["dtype"]) for p in result["probes"]] == [(1, "float32"), (2, "float32")]
    for p in result["probes"]:
        assert p["packed_linear_ms"] > 0 and p["raw_linear_ms"] > 0
        assert p["step_over_linear"] == pytest.approx(p["step_ms"] / p["packed_linear_ms"])
    # Each thread count's runs keep their own files.
    names = sorted(f.name for f in (out / "runs").glob("*.json"))
    assert names == ["continuous_t1_float32_4_a.json", "continuous_t2_float32_4_a.json"]
    lines = table(result["rows"]).splitlines()
    assert lines[0].startswith("| threads |")
    assert lines[2].startswith("| 1 |") and lines[3].startswith("| 2 |")


def test_llamacpp_joins_with_its_own_arguments(
    tiny_model: Path, tmp_path: Path, keep_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--llamacpp FORMATS`` runs ``bench llamacpp`` after the engine's rows, at the first thread
    count, with its own defaults otherwise; without llama.cpp's virtualenv it says so and fails, the
    engine's rows already written."""
    from bench import peers

    args = peers.llamacpp_args("Q4_1,Q8_0", 2, tmp_path)
    assert (args.formats, args.threads, args.out) == ("Q4_1,Q8_0", 2, str(tmp_path / "llamacpp.json"))
    assert args.bursts == "16,64" and args.skip == ""  # bench llamacpp's own defaults
    seen: list[tuple[str, int]] = []
    original = peers.llamacpp_args

    def no_venv(formats: str, threads: int, out: Path) -> Any:
        seen.append((formats, threads))
        made = original(formats, threads, out)
        made.llamacpp_python = str(tmp_path / "missing" / "python")
        return made

    monkeypatch.setattr(peers, "llamacpp_args", no_venv)
    out = tmp_path / "peers"
    argv = ["peers", "--no-vllm", "--models", str(tiny_model), "--dtypes", "float32", "--threads", "2,1"]
    argv += ["--batches", "4:64", "--num-requests", "4", "--out", str(out), "--llamacpp", "Q4_1"]
    assert main(argv) == 2
    assert seen == [("Q4_1", 2)]
    result = json.loads((out / "peers.json").read_text())
    assert len(result["rows"]) == 2 and "llamacpp" not in result
