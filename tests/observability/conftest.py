"""Fixtures for the observability tests: a tiny checkpoint and a tracer that keeps spans in memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.llm_engine import LLMEngine
from engine.models.tiny import write_tiny_checkpoint


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    # A tiny model gains nothing from a second thread, and on a shared 2-core host the two threads
    # wait for each other: steps measured 10x slower. Restored after each test (other suites keep theirs).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    """A private provider (the global one can be set only once per process)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def make_engine(path: Path, **kwargs: object) -> LLMEngine:
    args: dict[str, object] = {"max_num_seqs": 4, "block_size": 8, "num_blocks": 64, "max_model_len": 256}
    args.update(kwargs)
    return LLMEngine.from_engine_args(str(path), **args)


def run_to_end(engine: LLMEngine, max_steps: int = 500) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests")
