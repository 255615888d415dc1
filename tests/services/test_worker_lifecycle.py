"""The worker's request status: every legal path, the events that change nothing, and an illegal event
logged as an error with the status kept (the worker never crashes over its own bookkeeping)."""

from __future__ import annotations

import logging

import pytest

from services.worker.lifecycle import RunEvent, RunState, RunStatus

S, E = RunStatus, RunEvent


def _after(*events: RunEvent) -> RunState:
    state = RunState("req-1")
    for event in events:
        state.send(event)
    return state


@pytest.mark.parametrize(
    ("events", "status"),
    [
        ((), S.FETCHED),
        ((E.CLAIM,), S.CLAIMED),
        ((E.CLAIM, E.START), S.RUNNING),
        ((E.CLAIM, E.START, E.FINISH), S.FINISHED),
        ((E.CLAIM, E.FINISH), S.FINISHED),  # every index finished in the log: nothing to run
        ((E.CLAIM, E.START, E.CANCEL), S.CANCELLED),
        ((E.CLAIM, E.START, E.CANCEL, E.FINISH), S.CANCELLED),  # its end is "cancelled"
        ((E.CANCEL, E.CLAIM), S.CANCELLED),  # cancelled while it waited for the claim
        ((E.HAND_BACK, E.CLAIM), S.HANDED_BACK),  # drained while it waited for the claim
        ((E.CLAIM, E.START, E.HAND_BACK), S.HANDED_BACK),
        ((E.CLAIM, E.START, E.ENGINE_DIED), S.HANDED_BACK),
        ((E.CLAIM, E.START, E.FENCE), S.FENCED),
        ((E.CLAIM, E.START, E.FINISH, E.FENCE), S.FENCED),  # its final publish was refused
        # Expected and ignored: a cancel reaching a run on its way out, a second hand-back, a fence of
        # a handed-back run (it stays handed back: its offset stays uncommitted).
        ((E.CLAIM, E.START, E.HAND_BACK, E.CANCEL), S.HANDED_BACK),
        ((E.CLAIM, E.START, E.CANCEL, E.HAND_BACK), S.CANCELLED),
        ((E.CLAIM, E.START, E.HAND_BACK, E.ENGINE_DIED), S.HANDED_BACK),
        ((E.CLAIM, E.START, E.HAND_BACK, E.FENCE), S.HANDED_BACK),
        ((E.CLAIM, E.START, E.FINISH, E.CANCEL), S.FINISHED),
    ],
)
def test_legal_paths(
    events: tuple[RunEvent, ...], status: RunStatus, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR, logger="services.worker.lifecycle"):
        assert _after(*events).status is status
    assert caplog.records == []


def test_an_error_makes_the_end_failed_with_its_code() -> None:
    state = _after(E.CLAIM, E.START)
    state.fail(1, "out of memory")
    state.fail(0, "no grammar", "invalid_request", "response_format")
    assert state.send(E.FINISH) and state.status is S.FAILED
    assert dict(state.errors) == {1: "out of memory", 0: "no grammar"}
    assert (state.error_code, state.error_param) == ("invalid_request", "response_format")
    with pytest.raises(TypeError):
        state.errors[2] = "read-only outside lifecycle.py"  # type: ignore[index]


def test_a_retry_starts_fetched_with_the_errors_kept() -> None:
    failed = _after(E.CLAIM, E.START)
    failed.fail(0, "the worker failed this request repeatedly", "worker_error")
    retry = failed.next_attempt()
    assert retry.status is S.FETCHED and dict(retry.errors) == dict(failed.errors)
    assert retry.error_code == "worker_error"
    retry.send(E.CLAIM)
    assert retry.send(E.FINISH) and retry.status is S.FAILED


def test_only_an_engine_death_while_running_counts_against_the_request() -> None:
    assert _after(E.CLAIM, E.START, E.ENGINE_DIED).engine_died_under
    assert not _after(E.CLAIM, E.ENGINE_DIED).engine_died_under  # never reached the engine
    assert not _after(E.CLAIM, E.START, E.HAND_BACK, E.ENGINE_DIED).engine_died_under  # drained first
    # A handed-back run its engine failed too often is failed here.
    died = _after(E.CLAIM, E.START, E.ENGINE_DIED)
    died.fail(0, "engines died under it 3 times", "engine_failed")
    assert died.send(E.FINISH) and died.status is S.FAILED


@pytest.mark.parametrize(
    ("events", "illegal"),
    [
        ((), E.START),  # into the engine without a claim
        ((), E.FINISH),  # an end written without a claim
        ((E.CLAIM, E.START), E.CLAIM),  # claimed twice
        ((E.CLAIM, E.START, E.FINISH), E.FINISH),  # finished twice
        ((E.CLAIM, E.START, E.FENCE), E.START),
        ((E.CLAIM, E.START, E.FENCE), E.FINISH),  # another worker owns it: nothing to write
    ],
)
def test_an_illegal_event_is_logged_and_changes_nothing(
    events: tuple[RunEvent, ...], illegal: RunEvent, caplog: pytest.LogCaptureFixture
) -> None:
    state = _after(*events)
    before = state.status
    with caplog.at_level(logging.ERROR, logger="services.worker.lifecycle"):
        assert state.send(illegal) is False
    assert state.status is before
    (entry,) = caplog.records
    assert entry.levelno == logging.ERROR
    assert entry.getMessage() == f"request req-1: illegal transition {before.name} --{illegal}--> (ignored)"
