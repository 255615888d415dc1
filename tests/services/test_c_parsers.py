"""The C parsers the services rely on for their per-token CPU are installed and picked up: uvicorn
parses HTTP with httptools, redis-py parses replies (a token event each, on the gateway) with hiredis.
Both fall back to pure Python silently when missing, which costs the gateway about a quarter more CPU
per streamed token, so a dropped dependency must fail here rather than in a benchmark."""

from __future__ import annotations

import uvicorn


def test_uvicorn_parses_http_with_httptools() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    config = uvicorn.Config(app=lambda scope, receive, send: None, http="auto")
    config.load()
    assert config.http_protocol_class is HttpToolsProtocol


def test_redis_parses_replies_with_hiredis() -> None:
    from redis.asyncio.connection import DefaultParser
    from redis.utils import HIREDIS_AVAILABLE

    assert HIREDIS_AVAILABLE
    assert DefaultParser.__name__ == "_AsyncHiredisParser"
