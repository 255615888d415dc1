"""What the routes share: settings, the model's facts, the store, the stream hub, the dispatcher."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from services.common.kafka import affinity_key
from services.common.settings import Settings
from services.common.store import Store
from services.common.wire import Kind, RequestMessage
from services.gateway.budgets import KEY_JOBS, KEY_STORED_JOBS, refuse
from services.gateway.dispatch import Dispatcher
from services.gateway.errors import APIError
from services.gateway.prompts import ModelInfo, Prepared
from services.gateway.quotas import JobQuota, Taken
from services.gateway.token_streams import Hub, Subscription


@dataclass
class Gateway:
    settings: Settings
    info: ModelInfo
    store: Store
    hub: Hub
    dispatcher: Dispatcher
    _background: set[asyncio.Task[Any]] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Fire and forget, but keep a reference (and survive the caller being cancelled)."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def enqueue(
        self,
        kind: Kind,
        prepared: Prepared,
        *,
        job: bool,
        subscribe: bool,
        stream: bool = False,
        extra: dict[str, str | int | float] | None = None,
        start_within_s: float | None = None,
        request_id: str | None = None,
        owner: str = "",
    ) -> tuple[RequestMessage, Subscription | None]:
        """Admit and produce one request of ``owner`` (its key's digest, ``owner_of``); ``start_within_s``:
        its deadline, counted from now."""
        created = time.time()
        msg = RequestMessage(
            id=request_id or new_request_id(kind, job),
            kind=kind,
            model=self.info.name,
            prompt_token_ids=prepared.prompt_token_ids,
            params=prepared.params,
            created=created,
            priority=prepared.priority,
            job=job,
            prompt=prepared.text,
            messages=prepared.messages,
            add_generation_prompt=prepared.add_generation_prompt,
            slo_ttft_ms=prepared.slo_ttft_ms,
            slo_tpot_ms=prepared.slo_tpot_ms,
            stream=stream,
            deadline=None if start_within_s is None else created + start_within_s,
        )
        record: dict[str, str | int | float] = {
            "kind": kind,
            "model": msg.model,
            "created": f"{msg.created:.6f}",
            "job": int(job),
            "n": prepared.params.n,
            "prompt_tokens": len(prepared.prompt_token_ids),
            "logprobs": "" if prepared.params.logprobs is None else prepared.params.logprobs,
            # A synchronous request lives only as long as this gateway's connection to its client:
            # workers abort it once this gateway's liveness key lapses (it died without cancelling).
            **({} if job else {"origin": self.settings.instance_id}),
            **(extra or {}),
        }
        text = prepared.text or "".join(str(m.get("content") or "") for m in prepared.messages or [])
        block = self.settings.affinity_block_tokens
        key = affinity_key(prepared.prompt_token_ids, block, prepared.session, text)
        # Trace context headers are added by the produce span (the client's traceparent is its ancestor).
        sub = await self.dispatcher.submit(msg, key, [], record, subscribe=subscribe, owner=owner)
        return msg, sub


def new_request_id(kind: Kind, job: bool) -> str:
    prefix = "job" if job else ("cmpl" if kind == "completion" else "chatcmpl")
    return f"{prefix}-{uuid.uuid4().hex}"


def owner_of(request: Request) -> str:
    """Whose request this is: a digest of its API key (edge.KeyGuard), "" with keys off (everyone)."""
    return str(getattr(request.state, "key_owner", ""))


def job_quota(gw: Gateway) -> JobQuota:
    s = gw.settings
    return JobQuota(gw.store.client, s.max_jobs_per_key, s.job_ttl_s, s.max_stored_jobs_per_key)


def quota_refusal(quota: JobQuota, taken: Taken, what: str) -> APIError:
    """The 429 for a key at one of its job quotas (``what``: the things counted, for the message)."""
    if taken is Taken.UNFINISHED_FULL:
        message = (
            f"this API key has {quota.cap} unfinished {what}, the most it may have; "
            "submit more once some finish (or cancel some)"
        )
        return refuse(KEY_JOBS, message, retry_after_s=5)
    message = (
        f"this API key has {quota.stored_cap} {what} whose results are kept, the most it may have; finished "
        f"ones leave {quota.job_ttl_s} s after they were created"
    )
    return refuse(KEY_STORED_JOBS, message, retry_after_s=5)


def gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw
