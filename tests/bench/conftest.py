"""Fixtures of the benchmark tests: the tiny checkpoint (about 1M parameters), written once."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.models.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("bench-tiny"), arch="llama")
