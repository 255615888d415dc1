"""What the worker needs from an engine, as a Protocol: two classes answer it.

``engine.core.client.EngineCoreClient`` (the default: the engine core in its own process) and
``engine.async_engine.AsyncLLMEngine`` (the engine loop on a thread of this process; in-process tests
and ``INFLIGHT_ENGINE_PROCESS=false``). The worker's modules name exactly the calls they rely on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the gateway image has no torch; these are types only
    from engine.metrics import EngineMetrics, SchedulerStats
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def max_model_len(self) -> int: ...

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

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        resume_token_ids: list[int] | None = None,
        resume_by_index: Mapping[int, Sequence[int]] | None = None,
        indexes: Sequence[int] | None = None,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...
