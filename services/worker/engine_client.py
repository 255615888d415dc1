"""What the worker needs from an engine, as a Protocol: two classes answer it.

``engine.core.client.EngineCoreClient`` (the default: the engine core in its own process) and
``engine.async_engine.AsyncLLMEngine`` (the engine loop on a thread of this process; in-process tests
and ``INFLIGHT_ENGINE_PROCESS=false``). The worker's modules name exactly the calls they rely on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the gateway image has no torch; these are types only
    from engine.inputs import EngineRequest, PromptLimits
    from engine.metrics import EngineMetrics, SchedulerStats
    from engine.outputs import RequestOutput
    from engine.tokenizer import Tokenizer


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def prompt_limits(self) -> PromptLimits:
        """What the engine checks prompts against (its config's max_model_len, its vocabulary)."""

    @property
    def pid(self) -> int | None:
        """The process that steps the engine (None before it starts)."""

    @property
    def metrics(self) -> EngineMetrics: ...

    @property
    def load(self) -> SchedulerStats:
        """The engine's load as of its last step (waiting, running, KV): read, never its live state."""

    @property
    def num_unacknowledged(self) -> int:
        """Requests handed to ``generate`` that the engine has not taken yet: ``load`` does not count them."""

    @property
    def dead_error(self) -> BaseException | None: ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...
