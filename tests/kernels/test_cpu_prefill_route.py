"""Which path long CPU prefill chunks take: timed once per shape on this host, or forced by the env."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention import cpu_prefill
from engine.attention.cpu_prefill import PrefillShape
from engine.kernels import cpu as cpu_kernels
from engine.models.tiny import write_tiny_checkpoint

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels could not be built here")

SMOL = PrefillShape(9, 3, 64, torch.float32)


@pytest.fixture(autouse=True)
def fresh_probe(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("INFLIGHT_CPU_PREFILL_ATTENTION", raising=False)
    cpu_prefill._timed.cache_clear()
    yield
    cpu_prefill._timed.cache_clear()


def test_sdpa_is_picked_only_when_clearly_faster():
    assert cpu_prefill.pick(kernel_s=1.0, sdpa_s=0.5) == "sdpa"
    # within the margin the kernel stays: it reads the cache in place, SDPA gathers it first
    assert cpu_prefill.pick(kernel_s=1.0, sdpa_s=1.0 / cpu_prefill.SDPA_MARGIN + 0.01) == "kernel"
    assert cpu_prefill.pick(kernel_s=0.5, sdpa_s=1.0) == "kernel"


def test_auto_times_both_paths_once_per_shape_and_thread_count(monkeypatch: pytest.MonkeyPatch):
    probes = []
    real = cpu_prefill.probe
    monkeypatch.setattr(cpu_prefill, "probe", lambda shape: probes.append(shape) or real(shape))
    first = cpu_prefill.choose(SMOL)
    assert first.kernel_s is not None and first.sdpa_s is not None
    assert first.kernel_s > 0 and first.sdpa_s > 0
    assert first.route == cpu_prefill.pick(first.kernel_s, first.sdpa_s)
    assert cpu_prefill.choose(SMOL) == first  # memoized: no second probe
    bf16 = PrefillShape(9, 3, 64, torch.bfloat16)
    cpu_prefill.choose(bf16)
    assert probes == [SMOL, bf16]


def test_the_env_forces_a_route_without_timing(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(cpu_prefill, "probe", lambda shape: pytest.fail("a forced route timed the paths"))
    for route in ("kernel", "sdpa"):
        monkeypatch.setenv("INFLIGHT_CPU_PREFILL_ATTENTION", route.upper())
        assert cpu_prefill.choose(SMOL) == cpu_prefill.PrefillChoice(route, None, None)
    monkeypatch.setenv("INFLIGHT_CPU_PREFILL_ATTENTION", "flash")
    with pytest.raises(ValueError, match="auto, kernel or sdpa"):
        cpu_prefill.choose(SMOL)


def test_the_probe_runs_at_engine_start_not_in_a_served_step(tmp_path, monkeypatch: pytest.MonkeyPatch):
    probes = []
    real = cpu_prefill.probe
    monkeypatch.setattr(cpu_prefill, "probe", lambda shape: probes.append(shape) or real(shape))
    path = write_tiny_checkpoint(tmp_path, arch="llama")
    llm = LLM(str(path), attention_backend="cpu", dtype="float32", max_num_seqs=2)
    model = llm.engine.runner.model
    assert probes == [PrefillShape(model.num_heads, model.num_kv_heads, model.head_dim, torch.float32)]
    # A 40-token prompt: a long chunk, routed by the choice made at start-up.
    llm.generate([list(range(3, 3 + 40))], SamplingParams(max_tokens=2))
    assert len(probes) == 1


def test_the_prefill_bench_prints_both_paths_and_the_pick(capsys: pytest.CaptureFixture[str]):
    from bench import cpu_prefill_bench

    assert cpu_prefill_bench.main(["--tokens", "16,40", "--repeats", "1", "--dtypes", "float32"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("float32")]
    assert [int(r[1]) for r in rows] == [16, 40]
    for row in rows:
        kernel_ms, sdpa_ms, ratio = float(row[2]), float(row[4]), float(row[6])
        assert kernel_ms > 0 and sdpa_ms > 0
        assert ratio == pytest.approx(sdpa_ms / kernel_ms, rel=0.02, abs=0.01)
        assert row[7] in ("kernel", "sdpa")
        assert float(row[8]) > 0  # SDPA on the prompt's own K/V
        if abs(ratio * cpu_prefill.SDPA_MARGIN - 1) > 0.05:  # printed times are rounded: not at the edge
            assert row[7] == cpu_prefill.pick(kernel_ms, sdpa_ms)
    # one query token sees one key: QK and PV are one multiply-add per head dimension each
    assert cpu_prefill_bench.causal_flops(1, SMOL) == 2 * 2 * 9 * 64
