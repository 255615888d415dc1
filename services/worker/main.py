"""``inflight worker``: load the model, join the consumer group, serve until SIGTERM, then drain."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from services.common.settings import Settings
from services.common.telemetry import setup_telemetry
from services.common.tracing import shutdown_tracing
from services.worker import faults
from services.worker.engine_client import EngineClient

log = logging.getLogger(__name__)


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


async def serve(settings: Settings) -> None:
    from services.common.store import connect_redis
    from services.worker.http import make_server
    from services.worker.live import LivePublisher
    from services.worker.live import stop as stop_live
    from services.worker.service import Worker
    from services.worker.telemetry import instrument_engine

    model = resolve_model(settings)
    began = time.monotonic()
    engine = await start_engine(model, settings)
    log.info("loaded %s in %.1fs", model, time.monotonic() - began)
    spans = instrument_engine(engine, settings)  # before the first request
    live = LivePublisher(settings.worker_id)  # the gateway's live page: recent steps, rate-limited
    live.attach(engine)
    live_task = asyncio.create_task(live.run_forever(connect_redis(settings)))
    worker = Worker(settings, engine, spans)
    server = make_server(worker, settings.bind_host, settings.worker_port)
    http = asyncio.create_task(server.serve())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(worker.drain()))
    await worker.start()
    await worker.wait_stopped()
    server.should_exit = True
    await http
    await stop_live(live_task)


async def start_engine(model: str, settings: Settings) -> EngineClient:
    """The engine core in its own process (the default), or its loop on a thread of this one."""
    if settings.engine_process:
        from engine.core.client import EngineCoreClient  # torch-free: the core process imports torch

        client = EngineCoreClient(
            model,
            settings.engine_args,
            torch_threads=settings.torch_threads,
            log_level=settings.log_level,
            setup=faults.install,
        )
        await client.start()
        return client
    from engine.async_engine import AsyncLLMEngine  # torch: the engine runs in this process

    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    engine = AsyncLLMEngine.from_engine_args(model=model, **settings.engine_args)
    faults.install(engine.engine)
    await engine.start()
    return engine


def main(settings: Settings) -> None:
    resolve_model(settings)  # no model: exit now, before telemetry and the event loop start
    tracing = setup_telemetry("inflight-worker", settings.log_level)
    try:
        asyncio.run(serve(settings))
    finally:
        shutdown_tracing(tracing)  # export the drained requests' spans before the process exits
