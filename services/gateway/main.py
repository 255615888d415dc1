"""``inflight gateway``: serve the FastAPI app with uvicorn."""

from __future__ import annotations

import uvicorn

from services.common.settings import Settings
from services.common.telemetry import setup_telemetry
from services.common.tracing import shutdown_tracing


def main(settings: Settings, port: int | None = None) -> None:
    from services.gateway.app import create_app

    tracing = setup_telemetry("inflight-gateway", settings.log_level)
    uvicorn.run(
        create_app(settings),
        host=settings.bind_host,
        port=port or settings.gateway_port,
        log_level="warning",
        # SIGTERM: stop accepting, let open streams finish within the drain timeout.
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        access_log=False,
    )
    shutdown_tracing(tracing)  # export the last requests' spans before the process exits
