"""The chart's tensor parallelism: worker.tensorParallelSize asks for that many GPUs in the one pod,
tells the worker, and the pod keeps its memory-backed /dev/shm (NCCL between the ranks)."""

from __future__ import annotations

import pytest

from tests.deploy.support import (
    KUBE_VERSIONS,
    component,
    env_of,
    main_container,
    manifests,
    pod_spec,
    render_chart,
    validate_object,
)


@pytest.mark.parametrize(("tp", "gpus"), [(1, 1), (4, 4)])
def test_tensor_parallel_size_sets_the_gpus_and_the_setting(tp: int, gpus: int) -> None:
    objs = manifests(render_chart({"worker": {"tensorParallelSize": tp}}))
    worker = component(objs, "worker")
    container = main_container(worker)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert env_of(container, objs)["INFLIGHT_TENSOR_PARALLEL_SIZE"] == str(tp)
    (shm,) = [v for v in pod_spec(worker)["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])
    for version in KUBE_VERSIONS:
        validate_object(worker, version)


def test_a_cpu_worker_asks_for_no_gpu_whatever_its_ranks() -> None:
    objs = manifests(render_chart({"worker": {"tensorParallelSize": 2, "gpu": {"count": 0}}}))
    container = main_container(component(objs, "worker"))
    assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    assert env_of(container, objs)["INFLIGHT_TENSOR_PARALLEL_SIZE"] == "2"
