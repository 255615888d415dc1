"""A batch's pace (services.gateway.batches.pace_credit): at most ``batch_max_queued`` lines a second,
spread over the sweep's rounds, however often clients read (and so advance) the batch."""

from __future__ import annotations

import pytest

from services.gateway.batches import SWEEP_S, pace_credit

RATE = 16.0
CEILING = 2 * RATE * SWEEP_S + 1  # the most lines one round may submit


def _run(times: list[float], rate: float = RATE) -> list[int]:
    """The lines each round at ``times`` submits with an endless supply of lines."""
    record: dict[str, str] = {}
    submitted = []
    for now in times:
        credit = pace_credit(record, rate, now)
        n = int(credit)
        submitted.append(n)
        if n:  # as _submit stores it once a round has submitted
            record.update(paced_at=f"{now:.6f}", pace_credit=f"{credit - n:.6f}")
    return submitted


def test_the_first_round_submits_at_most_two_sweeps_share() -> None:
    assert pace_credit({}, RATE, 100.0) == pytest.approx(CEILING)


def test_credit_carries_over_between_rounds() -> None:
    record = {"paced_at": "100.0", "pace_credit": "0.2"}
    assert pace_credit(record, RATE, 100.2) == pytest.approx(0.2 + RATE * 0.2)


def test_a_pause_does_not_let_a_burst_through() -> None:
    record = {"paced_at": "100.0", "pace_credit": "0"}
    assert pace_credit(record, RATE, 160.0) == pytest.approx(CEILING)


def test_late_rounds_keep_the_rate() -> None:
    # Rounds come every 0.23 s (the sweep's sleep plus its own work): the carried credit keeps the
    # average at the rate rather than at the lines one round may take.
    times = [i * 0.23 for i in range(200)]
    total = sum(_run(times))
    assert RATE * times[-1] - 1 <= total <= RATE * times[-1] + CEILING


@pytest.mark.parametrize("read_every_s", [0.001, 0.01, 0.05])
def test_frequent_reads_neither_speed_the_batch_nor_burst(read_every_s: float) -> None:
    # A client polling the batch advances it on every read, between the sweep's rounds.
    duration = 10.0
    times = sorted(
        {round(i * 0.2, 6) for i in range(51)}
        | {round(i * read_every_s, 6) for i in range(int(duration / read_every_s) + 1)}
    )
    rounds = _run(times)
    assert sum(rounds) <= RATE * duration + CEILING
    assert max(rounds) <= CEILING


def test_a_slow_rate_still_submits_a_line() -> None:
    # batch_max_queued 2: 0.4 lines a round; the ceiling lets a whole line through once it has built up.
    times = [i * 0.2 for i in range(51)]
    assert sum(_run(times, rate=2.0)) == pytest.approx(20, abs=1)
