"""The slo policy's view of the host's speed: a moving level of measured / modelled step time."""

from __future__ import annotations

import math
import random

import pytest

from engine.sched.host_speed import HostSpeed


def test_level_follows_a_slower_host_within_its_window() -> None:
    speed = HostSpeed(window_s=1.0)
    assert speed.factor == 1.0
    # 25 ms steps that take 1.5x the model for two seconds (80 steps, two windows).
    replans = sum(speed.observe(0.025, 0.0375) for _ in range(80))
    assert speed.factor == pytest.approx(1.5, rel=0.15)
    assert 5 <= replans <= 80  # rebuilt as it moved, not at every step
    # Back to the model's speed: the level returns.
    for _ in range(200):
        speed.observe(0.025, 0.025)
    assert speed.factor == pytest.approx(1.0, abs=0.02)


def test_the_window_is_in_seconds_whatever_the_step_length() -> None:
    short, long = HostSpeed(1.0), HostSpeed(1.0)
    for _ in range(40):  # two seconds of 50 ms steps (25 ms modelled)
        short.observe(0.025, 0.05)
    for _ in range(5):  # two seconds of 400 ms steps (200 ms modelled)
        long.observe(0.2, 0.4)
    assert short.log_level == pytest.approx(long.log_level, rel=0.05)
    assert short.log_level == pytest.approx(math.log(2) * (1 - math.exp(-2)), rel=0.05)
    # A host 4x slower than calibrated: each step counts at most 2x the current level, yet the level
    # gets there in a few windows.
    far = HostSpeed(1.0)
    for _ in range(400):
        far.observe(0.025, 0.1)
    assert far.factor == pytest.approx(4.0, rel=0.03)


def test_one_stall_cannot_swing_the_plan_and_noise_averages_out() -> None:
    speed = HostSpeed(1.0)
    speed.observe(0.025, 3.0)  # a 3 s stall on a 25 ms step counts as one 50 ms step
    assert speed.log_level == pytest.approx(math.log(2) * (1 - math.exp(-0.05)))
    assert speed.factor < 1.04
    # Step-to-step noise of 0.2 in log around the model: the level stays within a few percent.
    rng = random.Random(3)
    speed = HostSpeed(1.0)
    levels = []
    for _ in range(4000):
        speed.observe(0.025, 0.025 * math.exp(rng.gauss(0.0, 0.2)))
        levels.append(speed.log_level)
    assert max(abs(x) for x in levels[200:]) < 0.15
    assert speed.observe(0.0, 0.1) is False and speed.observe(0.1, math.inf) is False
    with pytest.raises(ValueError):
        HostSpeed(0.0)
