"""LLMEngine: the engine core and its output processing in one process, stepped by the caller.

``step()`` runs one core step (``engine.core.engine_core``: token ids) and turns its outputs into text
deltas (``engine.core.output_processor``) on the same thread; the offline ``LLM`` and the in-process
client (``engine.core.client.InprocClient``) step it. A stop string found in the text finishes its
sequence in the core before ``step()`` returns, so the next step never runs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.config import EngineArgs, EngineConfig
from engine.core.engine_core import EngineCore
from engine.core.output_processor import OutputProcessor
from engine.inputs import EngineRequest, PromptLimits
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.kv_cache.manager import KVCacheManager
    from engine.metrics import EngineMetrics, SchedulerStats
    from engine.outputs import RequestOutput
    from engine.runner.model_runner import ModelRunner
    from engine.sched.scheduler import Scheduler
    from engine.tokenizer import Tokenizer

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config)
        self.tokenizer: Tokenizer | None = load_tokenizer_if_any(config.model_path)
        self.processor = OutputProcessor(self.tokenizer, self.core.prompt_limits, self.core.stop_sequence)
        self._pending: list[RequestOutput] = []  # outputs made between steps (aborts)

    @classmethod
    def from_engine_args(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.resolve(EngineArgs.from_kwargs(model, **kwargs)))

    # ---- the core's parts, for callers that inspect them between steps ----------------------
    @property
    def config(self) -> EngineConfig:
        return self.core.config

    @property
    def runner(self) -> ModelRunner:
        return self.core.runner

    @property
    def kv(self) -> KVCacheManager:
        return self.core.kv

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def metrics(self) -> EngineMetrics:
        return self.core.metrics

    @property
    def load(self) -> SchedulerStats:
        return self.core.load

    @property
    def prompt_limits(self) -> PromptLimits:
        return self.core.prompt_limits

    # ---- intake ----------------------------------------------------------------------------
    def add_request(
        self, request: EngineRequest | str, prompt: Prompt | None = None, params: SamplingParams | None = None
    ) -> list[int]:
        """Add a request (see ``EngineRequest``); with ``params.n`` > 1 it fans out in the core. Returns
        the prompt's token ids (text is tokenized here).

        ``add_request(request_id, prompt, params)`` is short for ``add_request(EngineRequest(request_id,
        prompt, params))``; every other field is set on an ``EngineRequest``.
        """
        if isinstance(request, str):
            if prompt is None:
                raise TypeError("add_request(request_id, prompt, params): the prompt is missing")
            request = EngineRequest(request, prompt, params or SamplingParams())
        elif prompt is not None or params is not None:
            raise TypeError("add_request(EngineRequest) takes no other argument: set its fields")
        prepared = self.processor.prepare(request)
        ids = self.core.add_request(prepared)
        self.processor.add(prepared, request.prompt if isinstance(request.prompt, str) else None)
        return ids

    def abort_request(self, request_id: str) -> None:
        """Abort a caller's request (all n sequences); its last output comes with the next ``step()``.
        Unknown or finished ids are a no-op."""
        self._pending += self.processor.process(self.core.abort_request(request_id))

    # ---- the loop --------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One step's outputs. With async scheduling these are the previous step's tokens: this call
        schedules and starts the next step before it waits for them."""
        outputs, self._pending = self._pending, []
        return outputs + self.processor.process(self.core.step())


def load_tokenizer_if_any(path: str) -> Tokenizer | None:
    """The checkpoint's tokenizer, or None where it has no tokenizer.json."""
    # Imported only when there is one: a GPU host benchmarking a random-weight checkpoint needs no
    # tokenizers package.
    from engine.models.gguf import local_tokenizer_files

    if not (local_tokenizer_files(path) / "tokenizer.json").is_file():
        return None
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(path)
