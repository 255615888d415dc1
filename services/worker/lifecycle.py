"""A request's status in this worker, and the only place it changes.

Every other module sends events (``RunState.send``) and reads the status; the transition table below
is the whole lifecycle:

    FETCHED --claim--> CLAIMED --start--> RUNNING --finish--> FINISHED | FAILED
       |                  |                  |
       +------------------+------------------+--cancel-------> CANCELLED --finish--> CANCELLED
       +------------------+------------------+--hand_back / engine_died--> HANDED_BACK
    any status except HANDED_BACK ----------------fence--> FENCED

    FETCHED      consumed from Kafka, not claimed yet (the claim may wait for another worker's lease)
    CLAIMED      its lease held, its log read: preparing the prompt, or about to finish without the engine
    RUNNING      in the engine
    CANCELLED    the client asked: it stops, and its record ends "cancelled"
    HANDED_BACK  it stops unfinished (a drain, or its engine died): another worker resumes it from the log
    FENCED       another worker owns it now, or its writes are refused: it stops silently
    FINISHED     its end is decided, "completed" (the publisher writes it)
    FAILED       its end is decided, "failed" (``errors`` says why, ``error_code`` what kind)

An event the table does not list for a status is a bug in the sender: it is logged as an error and the
status stays as it was (a worker never crashes over its own bookkeeping). Some events are expected and
change nothing (``_IGNORED``): a cancel that reaches a run already stopping, a second hand-back.

Errors are data beside the status: a run with n > 1 completions keeps running its other indexes after one
fails, and ``finish`` turns a run with any error into FAILED.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from enum import IntEnum, StrEnum
from types import MappingProxyType

log = logging.getLogger(__name__)


class RunStatus(IntEnum):
    """Ordered: every status past RUNNING stops the run (``stopping``), and the last two are ends."""

    FETCHED = 0
    CLAIMED = 1
    RUNNING = 2
    CANCELLED = 3
    HANDED_BACK = 4
    FENCED = 5
    FINISHED = 6
    FAILED = 7


class RunEvent(StrEnum):
    CLAIM = "claim"  # Store.start answered "ok": the lease and the epoch are this worker's
    START = "start"  # handed to the engine
    CANCEL = "cancel"  # the client cancelled (the cancel channel, its key at the claim, a gone origin)
    HAND_BACK = "hand_back"  # drain: stop without finishing
    ENGINE_DIED = "engine_died"  # the engine died or stalled: stop without finishing
    FENCE = "fence"  # the lease was lost, or the publisher's writes were refused
    FINISH = "finish"  # decide the end: cancelled, failed (any error) or completed


S, E = RunStatus, RunEvent
_STOPPING = (S.CANCELLED, S.HANDED_BACK, S.FENCED, S.FINISHED, S.FAILED)

# (status, event) -> the next status. FINISH is resolved by ``_finish_to`` (it depends on the errors).
_TRANSITIONS: dict[tuple[RunStatus, RunEvent], RunStatus] = {
    (S.FETCHED, E.CLAIM): S.CLAIMED,
    # Cancelled or handed back while the claim was under way: the claim still happened (the lease is
    # held), the run stays on its way out.
    (S.CANCELLED, E.CLAIM): S.CANCELLED,
    (S.HANDED_BACK, E.CLAIM): S.HANDED_BACK,
    (S.CLAIMED, E.START): S.RUNNING,
    **{(s, E.CANCEL): S.CANCELLED for s in (S.FETCHED, S.CLAIMED, S.RUNNING)},
    **{(s, E.HAND_BACK): S.HANDED_BACK for s in (S.FETCHED, S.CLAIMED, S.RUNNING)},
    **{(s, E.ENGINE_DIED): S.HANDED_BACK for s in (S.FETCHED, S.CLAIMED, S.RUNNING)},
    # A publish refused while finishing (another claim since) also fences a decided end.
    **{(s, E.FENCE): S.FENCED for s in S if s not in (S.FENCED, S.HANDED_BACK)},
}
# Ends that may be decided from each status: a handed-back run may still be failed here (its engine
# died under it too often), a cancelled one ends cancelled.
_FINISH_FROM = (S.CLAIMED, S.RUNNING, S.CANCELLED, S.HANDED_BACK)

# Events that may arrive in these statuses and change nothing.
_IGNORED: set[tuple[RunStatus, RunEvent]] = {
    # A run on its way out: whoever claims it next reads the cancel key; an end already decided stays.
    *((s, E.CANCEL) for s in (S.CANCELLED, S.HANDED_BACK, S.FENCED, S.FINISHED, S.FAILED)),
    # Drain and engine death reach every run the worker holds: those already ending end as they are.
    *((s, e) for s in _STOPPING for e in (E.HAND_BACK, E.ENGINE_DIED)),
    # Handed back first: its lease is dropped (the sender's job) and it stays handed back, so its
    # offset stays uncommitted and another worker reads it again.
    (S.FENCED, E.FENCE),
    (S.HANDED_BACK, E.FENCE),
}


class RunState:
    """One request's status in this worker, its errors and whether its engine died under it."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._status = RunStatus.FETCHED
        self._errors: dict[int, str] = {}  # completion index -> why it failed
        self._error_code = "engine_error"
        self._error_param: str | None = None  # with "invalid_request": the field to blame
        # The engine died or stalled while it ran this request (not while it waited for a claim): the
        # claim counts toward the request's bound on engine failures (poison.py).
        self.engine_died_under = False

    def __repr__(self) -> str:
        return f"RunState({self.request_id!r}, {self._status.name}, errors={self._errors})"

    # ---- reading -----------------------------------------------------------------------------
    @property
    def status(self) -> RunStatus:
        return self._status

    @property
    def stopping(self) -> bool:
        """It generates no more here: cancelled, handed back, fenced, or its end decided."""
        return self._status in _STOPPING

    @property
    def errors(self) -> Mapping[int, str]:
        return MappingProxyType(self._errors)

    @property
    def error_code(self) -> str:
        return self._error_code

    @property
    def error_param(self) -> str | None:
        return self._error_param

    # ---- events ------------------------------------------------------------------------------
    def send(self, event: RunEvent) -> bool:
        """Apply ``event``; True when the status changed. An event the table does not allow is logged
        as an error and changes nothing."""
        old = self._status
        if event is RunEvent.FINISH:
            new = self._finish_to() if old in _FINISH_FROM else None
        else:
            new = _TRANSITIONS.get((old, event))
        if new is None:
            if (old, event) not in _IGNORED:
                log.error(
                    "request %s: illegal transition %s --%s--> (ignored)", self.request_id, old.name, event
                )
            return False
        if event is RunEvent.ENGINE_DIED and old is RunStatus.RUNNING:
            self.engine_died_under = True
        self._status = new
        return new is not old

    def _finish_to(self) -> RunStatus:
        if self._status is RunStatus.CANCELLED:
            return RunStatus.CANCELLED
        return RunStatus.FAILED if self._errors else RunStatus.FINISHED

    def fail(self, index: int, message: str, code: str | None = None, param: str | None = None) -> None:
        """Completion ``index`` failed; ``code`` (with ``param``, the field to blame) names the kind, and
        replaces an earlier one. The run ends FAILED when it finishes."""
        self._errors[index] = message
        if code is not None:
            self.blame(code, param)

    def blame(self, code: str, param: str | None = None) -> None:
        """The kind of failure the run's errors are (the engine reports the cause before the error)."""
        self._error_code, self._error_param = code, param

    def next_attempt(self) -> RunState:
        """The state of a fresh attempt at the same request (worker.py's retry): FETCHED again, with the
        errors kept, so a run the worker gave up on is failed by its next attempt."""
        fresh = RunState(self.request_id)
        fresh._errors = dict(self._errors)
        fresh._error_code, fresh._error_param = self._error_code, self._error_param
        return fresh
