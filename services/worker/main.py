"""``inflight worker``: load the model, join the consumer group, serve until SIGTERM, then drain.

A worker whose engine core stalled (``engine/core/watchdog.py``: it had work and sent nothing within its
bound, and was killed) hands its requests back, leaves the group, and exits with ``EXIT_ENGINE_STALLED``
once a readiness probe has seen it not ready (or after ``STALL_EXIT_WAIT_S``): a stall may be a wedged
driver or device, which only a fresh process (a restarted container) can clear. The in-process engine
(``INFLIGHT_ENGINE_PROCESS=false``) has no such watch: a thread cannot be killed. A worker whose engine
died and that cannot leave the consumer group within 20 s exits with ``EXIT_HAND_OVER``: its broker
session ending is then what hands its partitions to live workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from engine.core.client import EngineClient, make_client
from services.common.process_telemetry import setup_telemetry
from services.common.settings import Settings
from services.common.tracing import shutdown_tracing
from services.worker import faults

if TYPE_CHECKING:
    from services.worker.http import Probes
    from services.worker.worker import Worker

log = logging.getLogger(__name__)

EXIT_ENGINE_STALLED = 3
EXIT_HAND_OVER = 4  # the engine died and the consumer group could not be left
# How long a stalled worker waits for a readiness probe to see it not ready before it exits anyway:
# Kubernetes probes readiness every 10 s by default.
STALL_EXIT_WAIT_S = 10.0


# INFLIGHT_MODEL's name for the small random-weight checkpoint of engine/models/tiny.py: its answers are
# noise, so a worker serves it only when asked for it by name, never as a silent default.
TINY_RANDOM_MODEL = "tiny-random"

NO_MODEL = (
    "inflight worker: no model to serve. Set INFLIGHT_MODEL (or --model) to an HF checkpoint directory "
    "or a .gguf file; INFLIGHT_MODEL=tiny-random serves a small random-weight model for tests and demos."
)


def resolve_model(settings: Settings) -> str:
    """The checkpoint path to load; exits with a clear message when none is configured."""
    if not settings.model:
        raise SystemExit(NO_MODEL)
    if settings.model == TINY_RANDOM_MODEL:
        from engine.models.tiny import default_model_path  # written on first use

        return str(default_model_path())
    return settings.model


async def serve(settings: Settings) -> int:
    """Serve until stopped; the process's exit code (0, or ``EXIT_ENGINE_STALLED``)."""
    from services.common.store import connect_redis
    from services.worker.http import Probes, bind_port, make_server
    from services.worker.live_publisher import LivePublisher
    from services.worker.live_publisher import stop as stop_live
    from services.worker.worker import Worker
    from services.worker.worker_telemetry import instrument_engine

    model = resolve_model(settings)
    sockets = [bind_port(settings.bind_host, settings.worker_port)]
    began = time.monotonic()
    engine = await start_engine(model, settings)
    if settings.chat_template and engine.tokenizer is not None:  # the operator's, over the checkpoint's
        engine.tokenizer.chat_template = Path(settings.chat_template).read_text(encoding="utf-8")
    log.info("loaded %s in %.1fs", model, time.monotonic() - began)
    spans = instrument_engine(engine, settings)  # before the first request
    live = LivePublisher(settings.worker_id)  # the gateway's live page: recent steps, rate-limited
    live.attach(engine)
    live_task = asyncio.create_task(live.run_forever(connect_redis(settings)))
    worker = Worker(settings, engine, spans)
    probes = Probes()
    server = make_server(worker, settings.bind_host, settings.worker_port, probes)
    http = asyncio.create_task(server.serve(sockets=sockets))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(worker.drain()))
    try:
        await worker.start()
    except BaseException:
        # Kafka or Redis unreachable at start-up, say. The engine core ignores SIGTERM (see
        # engine/core/proc.py), so leaving it to multiprocessing's exit handler would hang this
        # process for good, up but serving nothing: stop everything, then fail for a restart.
        log.exception("the worker could not start")
        server.should_exit = True
        await engine.shutdown()  # first: whatever the steps below raise, the core must not outlive this
        await stop_live(live_task)
        await http
        raise
    from engine.platform.memory import freeze_heap  # torch-free

    # Started: what is loaded now lives as long as the process (with an in-process engine, the model).
    freeze_heap()
    stall_exit = asyncio.create_task(_exit_after_stall(worker, probes))
    await worker.wait_stopped()
    stall_exit.cancel()
    server.should_exit = True
    await http
    await stop_live(live_task)
    return EXIT_ENGINE_STALLED if _stalled(engine) else 0


def _stalled(engine: EngineClient) -> bool:
    from engine.core.watchdog import EngineStalled  # torch-free

    return isinstance(engine.dead_error, EngineStalled)


async def _exit_after_stall(worker: Worker, probes: Probes) -> None:
    await worker.handed_over.wait()  # a dead engine's requests are back in Kafka, the group left
    if worker.hand_over_failed:
        # Still a member of the group, holding partitions it will never serve: only the end of this
        # process (its broker session) frees them. No clean shutdown: it would wait on the same stop.
        log.error("the engine is dead and the group could not be left: exiting (code %d)", EXIT_HAND_OVER)
        logging.shutdown()
        os._exit(EXIT_HAND_OVER)
    if not _stalled(worker.engine):
        return  # a core that died (killed, crashed) leaves the worker up: /healthz 500 says so
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(probes.saw_dead_engine.wait(), STALL_EXIT_WAIT_S)
    log.error("the engine core stalled: exiting (code %d) for a restart", EXIT_ENGINE_STALLED)
    await worker.drain()


async def start_engine(model: str, settings: Settings) -> EngineClient:
    """The engine core in its own process (the default), or its loop on a thread of this one."""
    from engine.platform.threads import torch_threads  # torch-free

    # Unset, the cores this process may run on (affinity, CPU quota, hyperthreads; engine/platform/threads.py)
    # rather than torch's default, which counts every CPU the container can see, less one core kept for
    # this process's own loop (Kafka, Redis for every token, HTTP) where there are two or more: with a
    # thread on every core, each time the loop runs it preempts one, and every other OpenMP thread
    # spins at the next barrier until it is back. vLLM's CPU backend keeps one for its scheduler too.
    threads = torch_threads(settings.torch_threads, reserve=1)
    from engine.core.watchdog import StallPolicy  # torch-free

    stall = StallPolicy(floor_s=settings.engine_stall_timeout_s, warmup_s=settings.engine_stall_warmup_s)
    # The core process imports torch; in process (engine_process off), this one does.
    client = make_client(
        model,
        settings.engine_args,
        in_process=not settings.engine_process,
        torch_threads=threads,
        log_level=settings.log_level,
        setup=faults.install,
        stall=stall,
    )
    await client.start()
    return client


def main(settings: Settings) -> None:
    resolve_model(settings)  # no model: exit now, before telemetry and the event loop start
    tracing = setup_telemetry("inflight-worker", settings.log_level)
    try:
        code = asyncio.run(serve(settings))
    finally:
        shutdown_tracing(tracing)  # export the drained requests' spans before the process exits
    if code:
        raise SystemExit(code)
