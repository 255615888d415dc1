"""Session-wide test setup."""

from __future__ import annotations

import os

import pytest

# Triton kernels run under the interpreter on hosts without CUDA. Set before anything imports
# triton: pytest may collect tests/engine (which can import engine.kernels) before tests/kernels.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # the gateway-only environment has no torch
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The suite's token-exact checks compare against float32 references (HF transformers in float32, an
# undisturbed run of the same engine), so `dtype="auto"` resolves to float32 here on every host, in this
# process and in the workers it spawns. bf16 is tested where a test asks for it by name.
os.environ.setdefault("INFLIGHT_CPU_AUTO_DTYPE", "float32")


# `make test PYTEST_WORKERS=N` runs the suite in N processes (pytest-xdist, `--dist loadgroup`). Each
# file is one group, so its module fixtures start once; the files that share the end-to-end
# `inflight dev` stack are one group, so it starts once. Groups are handed out in collection order, so
# the longest files go first: started last, one of them would hold the whole run while the other
# processes sit idle. The order comes from `pytest --durations`; a file missing here runs in its usual
# place.
_LONGEST_FIRST = (
    "tests/services/test_crash.py",
    "tests/services/test_worker_poison.py",
    "tests/engine/test_gguf.py",
    "tests/services/test_chaos.py",
    "tests/engine/test_hf_parity.py",
    "tests/engine/test_tensor_parallel.py",
    "tests/services/test_restarts.py",
    "tests/services/test_nothing_lost.py",
    "tests/e2e/test_readme.py",
    "tests/e2e/test_live_page.py",
    "tests/bench/test_vllm_target.py",
    "tests/engine/test_core_process.py",
    "tests/services/test_engine_core_faults.py",
    "tests/services/test_sse_edges.py",
    "tests/services/test_gateway_readiness.py",
    "tests/services/test_schemathesis.py",
    "tests/kernels/test_compile_for_gpu.py",
    "tests/bench/test_peers.py",
    "tests/plan/test_policy_bench.py",
    "tests/services/test_redis_errors.py",
    "tests/services/test_orphans.py",
    "tests/services/test_deadlines.py",
    "tests/kernels/test_sampling_kernel.py",
    "tests/plan/test_validate.py",
    "tests/services/test_supervise.py",
    "tests/observability/test_service_path.py",
    "tests/services/test_cancel_reconnect.py",
    "tests/services/test_structured_api.py",
    "tests/services/test_tp_stack.py",
    "tests/services/test_admission.py",
)
_SHARED_GROUPS = {"tests/e2e/test_readme.py": "e2e-stack", "tests/e2e/test_live_page.py": "e2e-stack"}


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return  # one process: the usual order
    rank = {path: i for i, path in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: ties keep order
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(_SHARED_GROUPS.get(path, path)))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "serial: compares a prediction or a cost with a timed run; under PYTEST_WORKERS (the Makefile) it "
        "runs after the rest, alone in one process, so no other test's CPU moves its figures",
    )
