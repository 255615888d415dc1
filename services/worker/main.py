"""``inflight worker``: load the model, join the consumer group, serve until SIGTERM, then drain."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from services.common.settings import Settings
from services.common.telemetry import configure_logging

log = logging.getLogger(__name__)


def resolve_model(settings: Settings) -> str:
    if settings.model:
        return settings.model
    from engine.models.tiny import default_model_path  # the local stack's default

    return str(default_model_path())


async def serve(settings: Settings) -> None:
    from engine.async_engine import AsyncLLMEngine  # torch: imported only by the worker
    from services.worker.http import make_server
    from services.worker.service import Worker

    if settings.torch_threads:
        import torch

        torch.set_num_threads(settings.torch_threads)
    model = resolve_model(settings)
    began = time.monotonic()
    engine = AsyncLLMEngine.from_engine_args(model=model, **settings.engine_args)
    log.info("loaded %s in %.1fs", model, time.monotonic() - began)
    worker = Worker(settings, engine)
    server = make_server(worker, settings.bind_host, settings.worker_port)
    http = asyncio.create_task(server.serve())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(worker.drain()))
    await worker.start()
    await worker.wait_stopped()
    server.should_exit = True
    await http


def main(settings: Settings) -> None:
    configure_logging(settings.log_level)
    asyncio.run(serve(settings))
