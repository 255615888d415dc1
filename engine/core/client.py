"""What a caller needs from an engine (``EngineClient``), and the one factory that makes one.

Two clients answer it, both streaming ``RequestOutput`` deltas with text made beside them
(``engine.core.output_processor``):

* ``EngineCoreClient`` (process_client.py): the engine core in a spawned process of its own, the
  worker's default; this process stays torch-free.
* ``InprocClient`` (inproc_client.py): the core stepped on a thread of this process (in-process tests,
  ``INFLIGHT_ENGINE_PROCESS=false``); importing it imports torch.

    caller ── make_client(...) ─┬─ EngineCoreClient ══ pipe ══▶ EngineCore (proc.py, its own process)
                                └─ InprocClient ── thread ──▶ LLMEngine ──▶ EngineCore
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from engine.core.process_client import EngineCoreClient

if TYPE_CHECKING:  # the in-process client imports torch: never at this module's import
    from engine.core.inproc_client import InprocClient
    from engine.core.watchdog import StallPolicy
    from engine.inputs import EngineRequest, PromptLimits
    from engine.metrics import EngineMetrics, SchedulerStats
    from engine.outputs import RequestOutput
    from engine.tokenizer import Tokenizer

__all__ = ["EngineClient", "EngineCoreClient", "InprocClient", "make_client"]


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


def make_client(
    model: str,
    engine_args: Mapping[str, Any] | None = None,
    *,
    in_process: bool = False,
    torch_threads: int | None = None,
    log_level: str = "INFO",
    setup: Callable[[Any], None] | None = None,
    stall: StallPolicy | None = None,
) -> EngineClient:
    """An engine client, not started yet (``await client.start()``). ``setup(engine)`` runs once the
    engine is built, on the process that steps it (fault injection). ``stall`` (the watchdog of a
    core process) has no in-process meaning: a thread cannot be killed."""
    if not in_process:
        return EngineCoreClient(
            model, engine_args, torch_threads=torch_threads, log_level=log_level, setup=setup, stall=stall
        )
    import torch

    from engine.core.inproc_client import InprocClient

    if torch_threads:
        torch.set_num_threads(torch_threads)
    client = InprocClient.from_engine_args(model, **dict(engine_args or {}))
    if setup is not None:
        setup(client.engine)
    return client


def __getattr__(name: str) -> Any:
    if name == "InprocClient":  # lazily: it imports torch
        from engine.core.inproc_client import InprocClient

        return InprocClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
