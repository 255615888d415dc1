"""``inflight gateway``: serve the FastAPI app with uvicorn."""

from __future__ import annotations

import uvicorn

from services.common.settings import Settings
from services.common.telemetry import configure_logging


def main(settings: Settings, port: int | None = None) -> None:
    from services.gateway.app import create_app

    configure_logging(settings.log_level)
    uvicorn.run(
        create_app(settings),
        host=settings.bind_host,
        port=port or settings.gateway_port,
        log_level="warning",
        # SIGTERM: stop accepting, let open streams finish within the drain timeout.
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        access_log=False,
    )
