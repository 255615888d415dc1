"""Mixture-of-experts kernels: the grouped CPU path and the grouped Triton kernels (the interpreter
without a GPU) against the per-token reference, the block alignment, and the grouping itself: unused
experts are never read, and the Triton path launches each GEMM once whatever the expert count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.kernels import fused_moe as triton_moe
from engine.kernels import moe, moe_cpu, moe_reference

ROOT = Path(__file__).resolve().parents[2]

# float32: the paths differ from the reference only in summation order (one matmul over many rows vs
# one row at a time; tl.dot's K blocking), measured at most ~1e-6 on these shapes.
F32_TOL: dict[str, Any] = {"atol": 1e-5, "rtol": 1e-5}
# bf16: projections and activation rounded to bf16 as in the reference, but a different summation order
# can flip a rounding, and the interpreter truncates float32 -> bf16 instead of rounding.
BF16_TOL: dict[str, Any] = {"atol": 3e-2, "rtol": 3e-2}
HIDDEN = 64


def _moe_inputs(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    inter: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, HIDDEN, generator=gen)
    # Scaled so each projection's output stays O(1), where the tolerances above are meaningful.
    w13 = torch.randn(num_experts, 2 * inter, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, inter, generator=gen) / inter**0.5
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = moe.route_topk(logits, top_k, renormalize=True)
    return (
        hidden.to(dtype).to(device),
        w13.to(dtype).to(device),
        w2.to(dtype).to(device),
        weights.to(device),
        ids.to(device),
    )


GRID = [
    (num_tokens, num_experts, top_k, inter)
    for num_tokens, inter in [(1, 32), (5, 48), (33, 96)]
    for num_experts in (4, 8)
    for top_k in (1, 2)
]


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "inter"), GRID)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_cpu_path_matches_reference(num_tokens, num_experts, top_k, inter, activation):
    args = _moe_inputs(num_tokens, num_experts, top_k, inter)
    want = moe_reference.fused_moe(*args, activation=activation)
    got = moe_cpu.fused_moe(*args, activation=activation)
    assert got.shape == (num_tokens, HIDDEN) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, **F32_TOL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_path_matches_reference_16_bit(dtype):
    args = _moe_inputs(17, 8, 2, 64, dtype=dtype, seed=3)
    got = moe_cpu.fused_moe(*args)
    assert got.dtype == dtype
    torch.testing.assert_close(got, moe_reference.fused_moe(*args), **BF16_TOL)


@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "inter"), GRID)
def test_triton_path_matches_reference(device, num_tokens, num_experts, top_k, inter):
    args = _moe_inputs(num_tokens, num_experts, top_k, inter, device=device)
    got = triton_moe.fused_moe(*args)
    assert got.shape == (num_tokens, HIDDEN) and got.dtype == torch.float32
    torch.testing.assert_close(got, moe_reference.fused_moe(*args), **F32_TOL)


@pytest.mark.parametrize(
    ("num_tokens", "activation", "dtype"),
    [(5, "gelu_tanh", torch.float32), (33, "gelu_tanh", torch.float32), (17, "silu", torch.bfloat16)],
)
def test_triton_path_activations_and_bf16(device, num_tokens, activation, dtype):
    args = _moe_inputs(num_tokens, 8, 2, 64, dtype=dtype, seed=1, device=device)
    got = triton_moe.fused_moe(*args, activation=activation)
    assert got.dtype == dtype
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(got, moe_reference.fused_moe(*args, activation=activation), **tol)


def test_align_block_size_worked_example():
    # The docstring's example: experts 1, 5, 7 chosen by 3, 2, 1 pairs, each run padded to 4 rows.
    sorted_pair_ids, block_expert_ids, num_post_padded = triton_moe.moe_align_block_size(
        torch.tensor([[5, 1], [1, 7], [5, 1]]), block_m=4, num_experts=8
    )
    assert sorted_pair_ids.tolist() == [1, 2, 5, 6, 0, 4, 6, 6, 3, 6, 6, 6] + [6] * 12
    assert block_expert_ids.tolist() == [1, 5, 7, -1, -1, -1]
    assert num_post_padded.tolist() == [12]
    assert sorted_pair_ids.dtype == block_expert_ids.dtype == num_post_padded.dtype == torch.int32


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m", "other_rank"),
    [(1, 64, 2, 16, 0), (40, 8, 2, 16, 0), (40, 8, 2, 16, 4)],
)
def test_align_block_size_invariants(num_tokens, num_experts, top_k, block_m, other_rank):
    gen = torch.Generator().manual_seed(5)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    # other_rank > 0: experts [E - other_rank, E) are another rank's, passed as -1.
    ids = torch.where(ids >= num_experts - other_rank, -1, ids)
    sorted_pair_ids, block_expert_ids, num_post_padded = triton_moe.moe_align_block_size(
        ids, block_m, num_experts
    )
    num_pairs = num_tokens * top_k
    used = int(num_post_padded)
    assert used % block_m == 0 and used <= sorted_pair_ids.numel()
    real = sorted_pair_ids[sorted_pair_ids < num_pairs]
    kept = (ids.reshape(-1) >= 0).nonzero().reshape(-1).tolist()
    assert len(kept) > 0 and (len(kept) < num_pairs) == (other_rank > 0)
    assert sorted(real.tolist()) == kept  # every pair of this rank's experts exactly once, no other
    assert bool((sorted_pair_ids[used:] == num_pairs).all())
    flat = ids.reshape(-1)
    for block in range(used // block_m):
        pairs = sorted_pair_ids[block * block_m : (block + 1) * block_m]
        pairs = pairs[pairs < num_pairs].long()
        assert pairs.numel() > 0  # no block is padding only
        assert bool((flat[pairs] == block_expert_ids[block]).all())
    assert bool((block_expert_ids[used // block_m :] == -1).all())


def _nan_in_unused_experts(
    w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    unused = torch.ones(w13.shape[0], dtype=torch.bool)
    unused[ids.reshape(-1).cpu()] = False
    assert bool(unused.any())
    w13, w2 = w13.clone(), w2.clone()
    w13[unused.to(w13.device)] = float("nan")
    w2[unused.to(w2.device)] = float("nan")
    return w13, w2


@pytest.mark.parametrize("path", ["cpu", "triton"])
def test_grouped_paths_never_read_unused_experts(device, path):
    # 3 tokens x 2 experts reach at most 6 of 32; any read of the other 26 would put NaN in the output.
    hidden, w13, w2, weights, ids = _moe_inputs(
        3, 32, 2, 32, seed=7, device="cpu" if path == "cpu" else device
    )
    want = moe_reference.fused_moe(hidden, w13, w2, weights, ids)
    poisoned = _nan_in_unused_experts(w13, w2, ids)
    got = moe.fused_moe(hidden, *poisoned, weights, ids, impl=path)  # type: ignore[arg-type]
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, **F32_TOL)


@pytest.mark.parametrize("impl", ["reference", "cpu", "triton"])
def test_sharded_experts_sum_to_the_layer(device, impl):
    # Two ranks of expert parallelism (experts 0-3 | 4-7, other ranks' ids as -1) and two of tensor
    # parallelism (each rank half of every expert's intermediate size): each pair of outputs sums to the
    # whole layer's, which is what the layer's all-reduce relies on.
    hidden, w13, w2, weights, ids = _moe_inputs(13, 8, 2, 64, seed=6, device=device)
    want = moe_reference.fused_moe(hidden, w13, w2, weights, ids)
    expert_parallel = []
    for first in (0, 4):
        mine = (ids >= first) & (ids < first + 4)
        local_ids = torch.where(mine, ids - first, -1)
        local = (w13[first : first + 4], w2[first : first + 4])
        expert_parallel.append(moe.fused_moe(hidden, *local, weights, local_ids, impl=impl))
    assert bool((expert_parallel[0] != 0).any() and (expert_parallel[1] != 0).any())
    torch.testing.assert_close(expert_parallel[0] + expert_parallel[1], want, **F32_TOL)
    gate, up = w13.chunk(2, dim=1)  # [E, I, H] each
    tensor_parallel = [
        moe.fused_moe(
            hidden,
            torch.cat([gate[:, part], up[:, part]], dim=1).contiguous(),  # [E, 2 * I/2, H]
            w2[:, :, part].contiguous(),  # [E, H, I/2]
            weights,
            ids,
            impl=impl,
        )
        for part in (slice(0, 32), slice(32, 64))
    ]
    torch.testing.assert_close(tensor_parallel[0] + tensor_parallel[1], want, **F32_TOL)
    nobody = moe.fused_moe(hidden, w13, w2, weights, torch.full_like(ids, -1), impl=impl)
    assert torch.equal(nobody, torch.zeros_like(hidden))


class _CountingKernel:
    """Stands in for a @triton.jit kernel: counts ``kernel[grid](...)`` launches, then runs the real one."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.grids: list[tuple[int, ...]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        self.grids.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("num_experts", [4, 64])
def test_triton_launches_each_gemm_once_whatever_the_expert_count(device, monkeypatch, num_experts):
    counting = _CountingKernel(triton_moe._grouped_gemm_kernel)
    monkeypatch.setattr(triton_moe, "_grouped_gemm_kernel", counting)
    args = _moe_inputs(9, num_experts, 2, 32, seed=2, device=device)
    got = moe.fused_moe(*args, impl="triton")
    # Two GEMMs (gate_up, down), one launch each, over every expert the 18 pairs chose.
    assert len(counting.grids) == 2
    torch.testing.assert_close(got, moe_reference.fused_moe(*args), **F32_TOL)


def test_dispatcher_picks_the_device_path(device):
    args = _moe_inputs(5, 8, 2, 32, seed=4, device=device)
    want = (triton_moe if device.type == "cuda" else moe_cpu).fused_moe(*args)
    assert torch.equal(moe.fused_moe(*args), want)
    assert torch.equal(moe.fused_moe(*args, impl="reference"), moe_reference.fused_moe(*args))
    with pytest.raises(ValueError, match="unknown MoE implementation"):
        moe.fused_moe(*args, impl="dense")  # type: ignore[arg-type]


def test_no_tokens():
    args = _moe_inputs(0, 8, 2, 32)
    for impl in ("cpu", "triton", "reference"):
        out = moe.fused_moe(*args, impl=impl)  # type: ignore[arg-type]
        assert out.shape == (0, HIDDEN)


def test_bad_shapes_are_refused():
    hidden, w13, w2, weights, ids = _moe_inputs(2, 4, 2, 32)
    with pytest.raises(AssertionError, match="w2 must be"):
        moe_cpu.fused_moe(hidden, w13, w2[:, :, :16], weights, ids)
    with pytest.raises(AssertionError, match="activation must be one of"):
        moe_cpu.fused_moe(hidden, w13, w2, weights, ids, activation="relu")
    with pytest.raises(AssertionError, match="topk_weights must be float32"):
        moe_cpu.fused_moe(hidden, w13, w2, weights.half(), ids)


_COMPILE = """
import sys
from tests.kernels.aot_compile import compile_one
from engine.kernels import fused_moe as m
gemm_types = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "weights_ptr": "*fp32",
    "sorted_pair_ids_ptr": "*i32", "block_expert_ids_ptr": "*i32", "num_post_padded_ptr": "*i32"}
ok = True
for mul_weight, c_type in ((False, "*bf16"), (True, "*fp32")):
    consts = {"PAIRS_PER_A_ROW": 2 if not mul_weight else 1, "MUL_WEIGHT": mul_weight, "BLOCK_M": 64,
        "BLOCK_N": 64, "BLOCK_K": 64, "DOT_FP32": False, "DOT_PRECISION": "tf32"}
    ok &= compile_one(f"moe grouped gemm MUL_WEIGHT={mul_weight}", m._grouped_gemm_kernel,
        {**gemm_types, "c_ptr": c_type}, consts)
for act in (0, 1):
    ok &= compile_one(f"moe act_and_mul {act}", m._act_and_mul_kernel, {"out_ptr": "*bf16", "x_ptr": "*bf16"},
        {"ACTIVATION": act, "BLOCK": 1024})
sys.exit(0 if ok else 1)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU compiles and runs the kernels itself")
def test_moe_kernels_compile_for_sm90(tmp_path: Path) -> None:
    # What the interpreter cannot catch: Triton's code generator for an H100/H200 (see aot_compile.py).
    try:
        from triton.backends import backends
    except ImportError:
        pytest.skip("triton not installed")
    if "nvidia" not in backends:
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), PYTHONPATH=str(ROOT), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("ok   ") == 4, proc.stdout


def test_moe_bench_runs_and_writes_its_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench import moe_bench

    out = tmp_path / "moe.json"
    argv = ["--experts", "4,16", "--tokens", "1,3", "--hidden", "32", "--intermediate", "16"]
    assert moe_bench.main([*argv, "--repeats", "1", "--iters", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["num_experts"], r["num_tokens"]) for r in rows] == [(4, 1), (4, 3), (16, 1), (16, 3)]
    # One token with k = 2 touches exactly 2 experts, whatever E is.
    assert [r["experts_touched"] for r in rows if r["num_tokens"] == 1] == [2, 2]
    assert "dense/grouped" in capsys.readouterr().out
