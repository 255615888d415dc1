"""bf16 on CPU rounds each step's row count up to whole GEMM tiles (engine/models/onednn.py): the
padded rows must change nothing a request sees, and the shapes must stay few enough to build at
start-up."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models import onednn
from engine.models.onednn import RowPadding
from engine.models.row_padding import EXACT_ROWS

# Runs of the same prompts compared: a prefix-cache hit would change the steps, not the padding.
_ARGS: dict[str, Any] = dict(
    block_size=8, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False
)

pytestmark = pytest.mark.skipif(
    not onednn.can_prepack(torch.bfloat16), reason="torch without oneDNN: bf16 weights are not packed"
)


@pytest.fixture(autouse=True)
def _onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    # Padding is oneDNN's business: on a host where the engine's own kernels are the default
    # (engine/models/cpu_gemm.py), nothing is padded.
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", "onednn")


@pytest.mark.parametrize("grain,limit", [(16, 512), (8, 300), (16, 2048), (16, 8192)])
def test_padded_counts_cover_every_count_with_few_shapes(grain: int, limit: int) -> None:
    padding = RowPadding(grain, limit)
    for n in range(1, limit + 1):
        p = padding.padded(n)
        assert n <= p <= limit
        assert p - n < (grain if n <= 1024 else 64)
    sizes = padding.sizes()
    assert sizes[-1] == limit
    # Five weight shapes a count must fit oneDNN's cache of 1,024 primitives.
    assert 5 * len(sizes) <= 1024
    assert padding.padded(limit + 3) == limit + 3  # beyond the budget: as it is


def test_a_few_rows_run_exact_where_each_row_costs_time() -> None:
    # A grain finer than EXACT_ROWS (no AMX): decode steps of a few sequences are not padded.
    fine = RowPadding(8, 300)
    assert [fine.padded(n) for n in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    assert fine.padded(EXACT_ROWS + 1) == 24
    assert fine.padded(299) == 300
    # AMX's tiles: 1 to 16 rows cost the same, so they still round up to a tile.
    assert RowPadding(16, 512).padded(3) == 16
    assert RowPadding(1, 64).padded(5) == 5


def test_the_grain_is_a_tile_only_for_bf16_on_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    for flags, bf16_grain in ((frozenset({"avx512f", "amx_bf16"}), 16), (frozenset({"avx512f"}), 8)):
        monkeypatch.setattr(onednn, "cpu_flags", lambda flags=flags: flags)
        assert onednn.row_grain(torch.bfloat16) == bf16_grain
        assert onednn.row_grain(torch.float32) == 8  # AMX multiplies no float32


def _generate_both(llm: LLM) -> tuple[list[int], list, list]:  # type: ignore[type-arg]
    """The same requests with the model's row padding and without; the token counts of the steps."""
    rng = random.Random(3)
    # Prompt lengths that make steps of many token counts: chunked prefills next to decodes.
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randint(3, 90))] for _ in range(10)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    model = llm.engine.runner.model
    counts: list[int] = []
    forward = model.forward

    def recording(input_ids: torch.Tensor, *args: object) -> torch.Tensor:
        counts.append(input_ids.shape[0])
        return forward(input_ids, *args)  # type: ignore[arg-type]

    model.forward = recording  # type: ignore[method-assign,assignment]
    padded = llm.generate(prompts, params)
    llm.engine.kv.check_integrity()  # raises on a leaked or double-owned block
    padding, model.kernels.row_padding = model.kernels.row_padding, None
    plain = llm.generate(prompts, params)
    model.kernels.row_padding = padding
    assert padding is not None and any(padding.padded(n) != n for n in counts), sorted(set(counts))
    return counts, padded, plain


def test_padded_rows_leak_into_nothing(tiny_llama_path: Path) -> None:
    """float32 with a padding of 16 rows (coarser than the host's own, if it pads): equal up to the
    GEMM's own row-count rounding, so a padded row reaching attention, the cache or a real row would
    show."""
    llm = LLM(str(tiny_llama_path), dtype="float32", **_ARGS)
    ops = llm.engine.runner.model.kernels
    assert (ops.row_padding is not None) == onednn.can_prepack(torch.float32) == (ops.prepack_rows > 0)
    ops.row_padding = RowPadding(16, 64)
    _, padded, plain = _generate_both(llm)
    for a, b in zip(padded, plain, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(abs(x[t] - y[t]) < 1e-4 for t in x)


def test_bf16_padding_content_reaches_no_real_row(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16, where the engine pads by itself: whatever the padded rows hold, every real token and
    log-probability is the same bit for bit; and against the unpadded run, within bf16's noise (on
    an AMX host they are identical: oneDNN's rows do not depend on the row count there, which another
    CPU's kernels need not promise)."""
    import engine.models.decoder as llama

    llm = LLM(str(tiny_llama_path), dtype="bfloat16", **_ARGS)
    assert llm.engine.runner.model.kernels.row_padding is not None, "bf16 on a oneDNN build pads rows"
    _, zeros, plain = _generate_both(llm)
    for a, b in zip(zeros, plain, strict=True):
        x, y = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert all(abs(x[t] - y[t]) < 0.05 for t in x.keys() & y.keys())
    monkeypatch.setattr(llama, "PAD_TOKEN_ID", 97)
    monkeypatch.setattr(llama, "PAD_POSITION", 41)
    _, other, _ = _generate_both(llm)
    for a, b in zip(zeros, other, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_warm_up_builds_every_shape_once() -> None:
    padding = RowPadding(16, 96)
    big = onednn.pack(torch.randn(48, 32, dtype=torch.bfloat16), 16)
    same_shape = onednn.pack(torch.randn(48, 32, dtype=torch.bfloat16), 16)
    head = onednn.pack(torch.randn(64, 32, dtype=torch.bfloat16), 16)
    # Six row counts for the two linears of one shape (built once), two for the head (<= 20 rows).
    assert onednn.warm_up([(big, 96), (same_shape, 96), (head, 20)], padding) == 6 + 2


def test_torch_gemm_keeps_plain_weights(tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``INFLIGHT_CPU_GEMM=torch``: nothing packed, nothing padded, the checkpoint's own tensors
    multiplied by torch; the same greedy tokens as oneDNN's packed weights."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42]]
    packed = LLM(str(tiny_llama_path), dtype="float32", **_ARGS)
    assert packed.engine.runner.model.kernels.prepack_rows > 0, "float32 packs where oneDNN can"
    expected = [o.outputs[0].token_ids for o in packed.generate(prompts, params)]
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", "torch")
    plain = LLM(str(tiny_llama_path), dtype="float32", **_ARGS)
    ops, layer = plain.engine.runner.model.kernels, plain.engine.runner.model.layers[0]
    assert ops.prepack_rows == 0 and ops.row_padding is None
    assert layer.mlp.gate_up_proj.weight.layout == torch.strided
    assert not onednn.can_prepack(torch.bfloat16)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == expected
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", "blas")
    with pytest.raises(ValueError, match="INFLIGHT_CPU_GEMM"):
        onednn.can_prepack(torch.float32)
