"""The CPU engine keeps freed memory mapped (engine/platform/memory.py, ``reuse_freed_memory``): once warm, a
prefill step allocates its activations on pages it already has instead of faulting fresh ones in.

Each case runs the engine in a subprocess: malloc's thresholds are process-wide and set once, so the
test process cannot hold both settings. Minor page faults are counted by the kernel (getrusage), not
timed, so the outcome does not depend on the host's speed.

With a model as small as this one a step's activations are a few MB each, and where the objects that
outlive a step land can still make the heap grow by one activation in an early round (about 660 faults;
unkept, 1,500-3,300 a round). The linear layers run on oneDNN's packed weights here, whose start-up
warm-up (every padded row count) leaves the heap near a step's size before the first request; on the
engine's own kernels, which build nothing at start-up, such rounds are more frequent (0-1,600 faults
in rounds 1-5). At SmolLM2-135M's size (1,920-token prefills) both paths fault 0-1 pages a warm round.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

_ROUNDS = 8
_SCRIPT = """
import json, random, resource, sys
import torch
torch.set_num_threads(1)
from engine import SamplingParams
from engine.platform import memory
from engine.llm_engine import LLMEngine

engine = LLMEngine.from_engine_args(
    sys.argv[1], max_num_seqs=16, max_num_batched_tokens=2048, enable_prefix_caching=False,
    dtype="float32", max_model_len=256, seed=0,
)
rng = random.Random(0)
vocab = engine.config.model.vocab_size
params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
faults = []
for round_ in range(int(sys.argv[2])):
    for i in range(16):
        engine.add_request(f"{round_}-{i}", [rng.randrange(vocab) for _ in range(120)], params)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.step()  # the prefill of all sixteen: 1,920 tokens
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    while engine.has_unfinished_requests():
        engine.step()
print(json.dumps({"reused": memory.reuse_freed_memory(), "faults": faults}))
"""


def _prefill_faults(model: Path, setting: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["INFLIGHT_CPU_MALLOC"] = setting
    env["INFLIGHT_CPU_GEMM"] = "onednn"  # the settled heap of the module's docstring
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(model), str(_ROUNDS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage")
def test_warm_prefill_steps_fault_no_pages_in(tiny_llama_path: Path) -> None:
    reuse = _prefill_faults(tiny_llama_path, "reuse")
    system = _prefill_faults(tiny_llama_path, "system")
    assert reuse["reused"] is True and system["reused"] is False
    # Left to itself glibc maps and unmaps a step's larger activations every step.
    assert min(system["faults"][1:]) > 1000, system  # type: ignore[index]
    # Kept, a settled heap faults nothing in; a round may still place one activation (~660 pages
    # here) past the heap's end while the objects that outlive a step find their places, so the last
    # rounds are compared, in total, with the same rounds unkept.
    late = slice(_ROUNDS // 2, None)
    assert sum(reuse["faults"][late]) < 0.1 * sum(system["faults"][late]), (reuse, system)  # type: ignore[index]


def test_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine import envs

    monkeypatch.setenv("INFLIGHT_CPU_MALLOC", "jemalloc")
    with pytest.raises(ValueError, match="reuse or system"):
        envs.cpu_malloc()
