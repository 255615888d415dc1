"""The engine's default thread count, decided from the host (engine/platform/threads.py): the physical
cores this process may run on, bounded by its cgroup's CPU quota and by one NUMA node. Each test builds a
fake /sys and /proc under tmp_path and hands the decision that root."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.platform import threads as platform
from engine.platform.threads import cpu_quota, decide_torch_threads, parse_cpu_list


def fake_host(
    root: Path,
    siblings: dict[int, str] | None,
    *,
    cgroup: str = "0::/\n",
    nodes: tuple[str, ...] = (),
) -> Path:
    """CPUs with their thread_siblings_list (None: no topology files at all), /proc/self/cgroup, and
    one directory per NUMA node with its cpulist."""
    for cpu, text in (siblings or {}).items():
        topo = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        topo.mkdir(parents=True)
        (topo / "thread_siblings_list").write_text(text + "\n")
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    for i, cpulist in enumerate(nodes):
        node = root / f"sys/devices/system/node/node{i}"
        node.mkdir(parents=True)
        (node / "cpulist").write_text(cpulist + "\n")
    return root


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


# 8 CPUs on 4 cores: CPU n and n + 4 are hyperthread siblings (Linux's usual numbering).
HT8 = {cpu: f"{cpu % 4},{cpu % 4 + 4}" for cpu in range(8)}


def test_parse_cpu_list() -> None:
    assert parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpu_list("5") == {5} and parse_cpu_list("") == set()


def test_one_thread_per_physical_core(tmp_path: Path) -> None:
    root = fake_host(tmp_path, HT8)
    choice = decide_torch_threads(set(range(8)), root)
    assert choice.threads == 4 and "4 physical cores among the 8 CPUs" in choice.reason


def test_the_affinity_mask_bounds_the_count(tmp_path: Path) -> None:
    root = fake_host(tmp_path, HT8)
    # taskset -c 0,1: two cores; taskset -c 0,4: one core's two hyperthreads.
    assert decide_torch_threads({0, 1}, root).threads == 2
    assert decide_torch_threads({0, 4}, root).threads == 1
    assert decide_torch_threads({0, 1, 4}, root).threads == 2


def test_no_topology_counts_every_allowed_cpu(tmp_path: Path) -> None:
    choice = decide_torch_threads({0, 1, 2}, fake_host(tmp_path, None))
    assert choice.threads == 3 and "no sysfs topology" in choice.reason


def test_cgroup_v2_quota_rounds_down_and_the_tightest_ancestor_wins(tmp_path: Path) -> None:
    siblings = {cpu: str(cpu) for cpu in range(16)}
    root = fake_host(tmp_path, siblings, cgroup="0::/kubepods/pod1/ctr\n")
    write(root / "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000")
    write(root / "sys/fs/cgroup/kubepods/pod1/cpu.max", "250000 100000")  # 2.5 CPUs for the pod
    write(root / "sys/fs/cgroup/kubepods/cpu.max", "800000 100000")
    assert cpu_quota(root) == 2.5
    choice = decide_torch_threads(set(range(16)), root)
    assert choice.threads == 2 and choice.reason.startswith("CPU quota 2.5 of the 16 cores allowed")


def test_a_quota_under_one_cpu_still_runs_one_thread(tmp_path: Path) -> None:
    root = fake_host(tmp_path, {0: "0", 1: "1"})
    write(root / "sys/fs/cgroup/cpu.max", "50000 100000")
    assert decide_torch_threads({0, 1}, root).threads == 1


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    siblings = {cpu: str(cpu) for cpu in range(8)}
    root = fake_host(tmp_path, siblings, cgroup="4:memory:/\n3:cpu,cpuacct:/docker/abc\n")
    write(root / "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "300000")
    write(root / "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000")
    write(root / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1")  # the root: no limit
    write(root / "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000")
    assert cpu_quota(root) == 3.0
    assert decide_torch_threads(set(range(8)), root).threads == 3


def test_no_quota_files_means_no_limit(tmp_path: Path) -> None:
    root = fake_host(tmp_path, {0: "0"}, cgroup="1:cpu:/\n0::/\n")
    assert cpu_quota(root) is None


def test_threads_stay_within_one_numa_node(tmp_path: Path) -> None:
    siblings = {cpu: str(cpu) for cpu in range(8)}
    root = fake_host(tmp_path, siblings, nodes=("0-3", "4-7"))
    choice = decide_torch_threads(set(range(8)), root)
    assert choice.threads == 4 and "NUMA node" in choice.reason and "(2 nodes)" in choice.reason
    # Allowed 0, 1, 2 on node 0 and 5 on node 1: the larger share is 3.
    assert decide_torch_threads({0, 1, 2, 5}, root).threads == 3
    # All on one node: no cap beyond the cores themselves.
    assert decide_torch_threads({4, 5, 6}, root).threads == 3


def test_physical_cores_follows_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform.os, "sched_getaffinity", lambda pid: {0})
    assert platform.physical_cores() == 1


def test_a_serving_process_takes_the_operators_count_or_the_hosts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(platform, "host_torch_threads", lambda: platform.ThreadChoice(3, "3 cores allowed"))
    with caplog.at_level(logging.INFO, logger="engine.platform.threads"):
        assert platform.torch_threads(5) == 5
        assert platform.torch_threads(None) == 3
    assert "torch threads: 5 (set by INFLIGHT_TORCH_THREADS)" in caplog.text
    assert "torch threads: 3 (3 cores allowed; INFLIGHT_TORCH_THREADS overrides)" in caplog.text


def test_a_worker_keeps_a_core_for_its_own_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A core left to the serving process where there are two or more; never zero threads; an
    operator's count as it is."""
    for cores, expected in ((4, 3), (2, 1), (1, 1)):
        choice = platform.ThreadChoice(cores, f"{cores} cores allowed")
        monkeypatch.setattr(platform, "host_torch_threads", lambda c=choice: c)
        assert platform.torch_threads(None, reserve=1) == expected
    assert platform.torch_threads(2, reserve=1) == 2
    with caplog.at_level(logging.INFO, logger="engine.platform.threads"):
        monkeypatch.setattr(
            platform, "host_torch_threads", lambda: platform.ThreadChoice(4, "4 cores allowed")
        )
        platform.torch_threads(None, reserve=1)
    assert "torch threads: 3 (4 cores allowed, 1 left to the serving process;" in caplog.text


def test_the_offline_engine_only_lowers_torchs_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(platform, "host_torch_threads", lambda: platform.ThreadChoice(1, "1 core allowed"))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert platform.limit_torch_threads() == 1 and torch.get_num_threads() == 1
        monkeypatch.setattr(platform, "host_torch_threads", lambda: platform.ThreadChoice(4, "4 cores"))
        assert platform.limit_torch_threads() == 1  # a lower count stands
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        monkeypatch.setattr(platform, "host_torch_threads", lambda: platform.ThreadChoice(1, "1 core"))
        assert platform.limit_torch_threads() == 2  # OMP_NUM_THREADS: the user's choice
    finally:
        torch.set_num_threads(before)
