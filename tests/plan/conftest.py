"""Fixtures shared by the planner tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama checkpoint with its tokenizer, written once per test session."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), arch="llama")
