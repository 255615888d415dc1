"""Per-file wall and CPU seconds of a pytest run (`pytest -p tests.cpu_report`).

CPU is pytest's own (RUSAGE_SELF) plus that of its reaped children (RUSAGE_CHILDREN): the stacks,
engine cores and fresh interpreters the tests start are children, counted once they are stopped and
reaped. A child a fixture keeps alive past its file (a session stack) is counted in the file that
stops it. On a 2-core host the suite is CPU-bound, so CPU seconds, not wall seconds, say where a cut
pays. `INFLIGHT_CPU_REPORT_TOP` sets how many files the summary lists (default 40). Under pytest-xdist
each worker measures its own files and hands them to the controller as it exits, which prints the sum.
"""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict

import pytest

_wall: dict[str, float] = defaultdict(float)
_cpu: dict[str, float] = defaultdict(float)
_tests: dict[str, int] = defaultdict(int)


def _cpu_now() -> float:
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    # The whole protocol (setup, call, teardown) so fixture start-up and shutdown count to the file
    # whose test caused them.
    path = item.nodeid.split("::", 1)[0]
    wall0, cpu0 = time.monotonic(), _cpu_now()
    yield
    _wall[path] += time.monotonic() - wall0
    _cpu[path] += _cpu_now() - cpu0
    _tests[path] += 1


def pytest_sessionfinish(session: pytest.Session) -> None:
    # An xdist worker: what it measured goes back to the controller with the worker's own output.
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output["cpu_report"] = {path: (_wall[path], _cpu[path], _tests[path]) for path in _wall}


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: absent without it
def pytest_testnodedown(node: object, error: object) -> None:
    measured = getattr(node, "workeroutput", {}).get("cpu_report", {})
    for path, (wall, cpu, tests) in measured.items():
        _wall[path] += wall
        _cpu[path] += cpu
        _tests[path] += tests


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _wall:
        return
    top = int(os.environ.get("INFLIGHT_CPU_REPORT_TOP", "40"))
    write = terminalreporter.write_line
    terminalreporter.section("cpu report: per file, most CPU first")
    write(f"{'cpu_s':>8} {'wall_s':>8} {'tests':>5}  file")
    for path in sorted(_cpu, key=lambda p: -_cpu[p])[:top]:
        write(f"{_cpu[path]:8.1f} {_wall[path]:8.1f} {_tests[path]:5d}  {path}")
    write(f"{sum(_cpu.values()):8.1f} {sum(_wall.values()):8.1f} {sum(_tests.values()):5d}  all files")
    write(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
