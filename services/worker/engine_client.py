"""What the worker needs from an engine: ``engine.async_engine.AsyncLLMEngine`` is the one that runs.

A Protocol, not the class, so the worker's modules say exactly which engine calls they rely on (and an
engine core in another process can stand behind the same calls later).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # the gateway image has no torch; these are types only
    from engine.config import EngineConfig
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer


class EngineClient(Protocol):
    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def dead_error(self) -> BaseException | None: ...

    def kv_stats(self) -> dict[str, float]: ...

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
