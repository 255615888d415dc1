"""Real servers for the service tests: a tansu broker and a Redis (or Valkey) on loopback ports.

The shared ``stack`` (one gateway, one worker) serves the tests that only send traffic; tests that
kill, restart or fill things build their own stack (and their own servers where a restart or a
shared key would disturb others). ``extra_gateway`` adds a gateway with settings of its own to the
shared stack, for a test module's lifetime.

``paced_stack`` serves the tests that act on a request while it runs (cancel it, disconnect from it,
ask who owns it): its worker's engine sleeps ``PACED_STEP_DELAY_S`` before every step, so a request of
N tokens runs for at least N times that on any host, however fast. ``paced_gateway`` adds a gateway
with settings of its own (API keys, say) to it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness.servers import ServerProcess, start_kafka, start_redis
from harness.stack import ServiceProcess, launch
from tests.services.stack import PACED_STEP_DELAY_S, REDIS_PASSWORD, Stack, new_stack


@pytest.fixture(scope="session")
def model_path() -> Path:
    from engine.models.tiny import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with start_kafka(workdir=tmp_path_factory.mktemp("kafka")) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with start_redis(password=REDIS_PASSWORD, workdir=tmp_path_factory.mktemp("redis")) as server:
        yield server


# The session's shared stacks by fixture name, while they run (see the hook below).
_RUNNING: dict[str, Stack] = {}
_LAST_USE: dict[str, int] = {}  # fixture name -> index of the last selected test that uses it


@pytest.hookimpl(trylast=True)  # after the test's own teardown: module fixtures on the stack are gone
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop a shared stack once the last test that uses it is done, not at the session's end: idle, a
    stack still costs about a tenth of a core (its worker's loops), which the own-stack tests after it
    would pay for. Only in a one-process run: there the order is the selection's order, while a
    pytest-xdist process learns its tests one batch at a time (it keeps them till the end)."""
    if not _RUNNING or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    items = item.session.items
    if not _LAST_USE:
        for i, other in enumerate(items):
            for name in getattr(other, "fixturenames", ()):  # a Function item has them
                if name in ("stack", "paced_stack"):
                    _LAST_USE[name] = i
    index = items.index(item) if nextitem is not None else len(items) - 1
    for name, shared in list(_RUNNING.items()):
        if index >= _LAST_USE.get(name, -1):
            del _RUNNING[name]
            shared.close()


@pytest.fixture(scope="session")
def stack(
    kafka: ServerProcess,
    redis_server: ServerProcess,
    model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    shared = new_stack(kafka, redis_server, model_path, tmp_path_factory.mktemp("stack"))
    _RUNNING["stack"] = shared
    yield shared
    _RUNNING.pop("stack", None)
    shared.close()  # a no-op once the hook above has stopped it


@pytest.fixture(scope="session")
def paced_stack(
    kafka: ServerProcess,
    redis_server: ServerProcess,
    model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    """A gateway and one paced worker on the session's broker and Redis, with a topic and consumer group
    of their own (``new_stack``): neither stack ever takes the other's requests, so the shared stack's
    traffic runs at full speed and this worker's requests are all the paced tests' own. Started by the
    first test that asks for it (one worker and one gateway: about 10-20 s on a 2-core host)."""
    paced = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path_factory.mktemp("paced"),
        INFLIGHT_FAULT_STEP_DELAY_S=PACED_STEP_DELAY_S,
    )
    _RUNNING["paced_stack"] = paced
    yield paced
    _RUNNING.pop("paced_stack", None)
    paced.close()  # a no-op once the hook above has stopped it


ExtraGateway = Callable[..., ServiceProcess]


def _gateways_on(stack: Stack) -> Iterator[ExtraGateway]:
    started: list[ServiceProcess] = []

    def start(**env: str) -> ServiceProcess:
        gateway = launch("gateway", {**stack.env, **env}, stack.log_dir)
        started.append(gateway)
        gateway.wait_ready()
        return gateway

    yield start
    for gateway in started:
        gateway.stop()


@pytest.fixture(scope="module")
def extra_gateway(stack: Stack) -> Iterator[ExtraGateway]:
    """``extra_gateway(INFLIGHT_X="...")``: a ready gateway on the shared stack's broker, Redis and
    workers with those settings on top of the stack's; stopped when the module's tests are done. Not
    added to ``stack.gateways``: the shared stack's own gateway stays the one its tests reach."""
    yield from _gateways_on(stack)


@pytest.fixture(scope="module")
def paced_gateway(paced_stack: Stack) -> Iterator[ExtraGateway]:
    """As ``extra_gateway``, on the paced stack: its requests go to the paced worker."""
    yield from _gateways_on(paced_stack)


@pytest.fixture
def own_servers(tmp_path: Path) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """A broker and a Redis for one test (restarts, a full pending set)."""
    with (
        start_kafka(workdir=tmp_path / "kafka") as k,
        start_redis(password=REDIS_PASSWORD, workdir=tmp_path / "redis") as r,
    ):
        yield k, r
