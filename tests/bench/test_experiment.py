"""The engine benchmark's rate search: halve or double until the TTFT limit is bracketed."""

from __future__ import annotations

from bench.experiment import _next_multiple


def test_rate_search_steps() -> None:
    assert _next_multiple({1.0}, set(), 0.25, 4.0) == 2.0
    assert _next_multiple(set(), {1.0}, 0.25, 4.0) == 0.5
    assert _next_multiple({0.5}, {1.0}, 0.25, 4.0) is None  # bracketed
    assert _next_multiple(set(), {1.0, 0.5, 0.25}, 0.25, 4.0) is None  # fails down to the floor
    assert _next_multiple({1.0, 2.0, 4.0}, set(), 0.25, 4.0) is None  # passes up to the ceiling
