"""The CPU KV cache on transparent huge pages (engine.platform.memory.huge_page_zeros).

What can be checked without depending on the host's free memory: the tensor is what torch.zeros would
give, starts on a 2 MiB boundary, and the kernel took the advice (the mapping holding it is marked
eligible for huge pages in /proc/self/smaps, whether or not the kernel found free 2 MiB pages).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineArgs, EngineConfig
from engine.platform import memory
from engine.runner.model_runner import ModelRunner

MIB = 1 << 20


def _thp_mode() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""


needs_thp = pytest.mark.skipif(
    "[madvise]" not in _thp_mode() and "[always]" not in _thp_mode(),
    reason="this host's kernel gives no transparent huge pages",
)


def _eligible(address: int) -> bool:
    """The THPeligible flag of the mapping of this process that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping of this process holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeroed_and_shaped_like_torch_zeros(dtype: torch.dtype) -> None:
    shape = (2, 37, 3, 16, 64)  # ~1.4-2.7 MiB: both sides of the 2 MiB threshold
    t = memory.huge_page_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.count_nonzero(t) == 0
    t.view(-1)[::2] = 1.5  # writable, and every element is its own
    assert torch.count_nonzero(t) == (t.numel() + 1) // 2


@needs_thp
def test_large_cache_is_advised_and_aligned() -> None:
    t = memory.huge_page_zeros((2, 512, 3, 16, 64), torch.float32)  # 12 MiB
    assert t.data_ptr() % (2 * MIB) == 0
    assert _eligible(t.data_ptr())
    assert _eligible(t.data_ptr() + t.numel() * 4 - 4 * MIB)


def test_small_or_thp_off_is_plain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(memory, "_THP_MODE", mode)
    memory.thp_available.cache_clear()
    try:
        t = memory.huge_page_zeros((2, 512, 3, 16, 64), torch.float32)
        assert torch.count_nonzero(t) == 0 and t.untyped_storage().nbytes() == t.numel() * 4  # torch's
    finally:
        memory.thp_available.cache_clear()
    small = memory.huge_page_zeros((4, 64), torch.float32)
    assert small.untyped_storage().nbytes() == 4 * 64 * 4 and torch.count_nonzero(small) == 0


@needs_thp
def test_model_runner_kv_cache_on_huge_pages(tiny_llama_path: Path) -> None:
    args = EngineArgs.from_kwargs(str(tiny_llama_path), num_blocks=2048, block_size=16, max_num_seqs=4)
    runner = ModelRunner(EngineConfig.resolve(args))
    for cache in runner.kv_caches:
        assert cache.data_ptr() % (2 * MIB) == 0 and _eligible(cache.data_ptr())
        assert torch.count_nonzero(cache) == 0


def test_on_huge_pages_copies_large_and_keeps_small() -> None:
    big = torch.randn(1024, 1024)  # 4 MiB
    moved = memory.on_huge_pages(big)
    assert torch.equal(moved, big) and moved.shape == big.shape
    small = torch.randn(16, 16)
    assert memory.on_huge_pages(small) is small
    if memory.thp_available():
        assert moved.data_ptr() != big.data_ptr() and moved.data_ptr() % (2 * MIB) == 0
        assert _eligible(moved.data_ptr())
    else:
        assert moved is big


def test_packed_weights_on_huge_pages() -> None:
    from engine.kernels import cpu as cpu_kernels
    from engine.models import cpu_gemm

    if not (cpu_kernels.load() and cpu_gemm.supported(torch.float32)):
        pytest.skip("the engine's own linear kernels do not run on this CPU")
    w = torch.randn(1024, 576)  # 2.25 MiB packed
    packed = cpu_gemm.pack(w)
    x = torch.randn(5, 576)
    torch.testing.assert_close(cpu_gemm.linear(x, packed), x @ w.T, rtol=1e-4, atol=1e-4)
    if memory.thp_available():
        assert packed.data_ptr() % (2 * MIB) == 0 and _eligible(packed.data_ptr())


def test_off_keeps_torch_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_CPU_HUGE_PAGES", "off")
    t = memory.huge_page_zeros((2, 512, 3, 16, 64), torch.float32)
    assert t.untyped_storage().nbytes() == t.numel() * 4 and torch.count_nonzero(t) == 0  # torch's own
    big = torch.randn(1024, 1024)
    assert memory.on_huge_pages(big) is big
    monkeypatch.setenv("INFLIGHT_CPU_HUGE_PAGES", "always")
    with pytest.raises(ValueError, match="madvise or off"):
        memory.huge_page_zeros((2, 512, 3, 16, 64), torch.float32)
