"""inflight's continuous-batching engine.

Imports are lazy so torch-free users (the gateway needs only the tokenizer and SamplingParams) never
pay for torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineArgs
    from engine.core.inproc_client import AsyncLLMEngine
    from engine.inputs import EngineRequest
    from engine.llm import LLM
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams

_EXPORTS = {
    "LLM": "engine.llm",
    "AsyncLLMEngine": "engine.core.inproc_client",
    "EngineArgs": "engine.config",
    "EngineRequest": "engine.inputs",
    "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
}

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineArgs",
    "EngineRequest",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
