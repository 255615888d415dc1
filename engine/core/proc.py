"""The core process: builds the engine, then steps it, answering commands between steps.

One message goes back per step (its outputs, its step record, the records of requests it finished and
the load after it), so the pipe's cost is per step, not per token or per request. Idle, the loop blocks
on the command pipe: a new request starts the next step at once, with no polling interval.

The process ignores SIGTERM and SIGINT: they reach it with its parent's process group (a terminal's
Ctrl-C, a test's killpg, a pod's stop), and the parent then drains, which needs this engine for
the grace period; it stops on ``Shutdown``, or when the pipe says the parent is gone.
"""

from __future__ import annotations

import logging
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from engine.core.messages import (
    AbortRequest,
    AddRequest,
    CoreDied,
    Inspect,
    Ready,
    Reply,
    Shutdown,
    StepMessage,
)
from engine.metrics import RequestRecord, StepRecord

logger = logging.getLogger(__name__)

# Read-only questions a client may ask between steps (tests and tools; never on the request path).
INSPECTIONS: dict[str, Callable[[Any], Any]] = {
    "kv_integrity": lambda engine: engine.kv.check_integrity(),
    "num_free_blocks": lambda engine: engine.kv.num_free_blocks,
}


def run_engine_core(
    model: str,
    engine_args: dict[str, Any],
    commands: Connection,
    results: Connection,
    torch_threads: int | None = None,
    log_level: str = "INFO",
    setup: Callable[[Any], None] | None = None,
) -> None:
    """The spawned process's entry point. ``setup(engine)`` runs once the engine is built (fault
    injection for tests; it must be importable by name, as spawn pickles it by reference)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s"
    )
    try:
        import torch

        if torch_threads:
            torch.set_num_threads(torch_threads)
        from engine.llm_engine import LLMEngine

        engine = LLMEngine.from_engine_args(model, **engine_args)
        if setup is not None:
            setup(engine)
    except BaseException:
        # Start-up failures (a bad path, a bad argument) go to the client as text; it raises them.
        _send(results, CoreDied(traceback.format_exc()))
        return
    config = engine.config
    description = (
        f"{config.model.architecture}, dtype {str(config.dtype).removeprefix('torch.')}, "
        f"{torch.get_num_threads()} torch threads"
    )
    if not _send(results, Ready(config.model_path, config.max_model_len, engine.load, description)):
        return
    _Loop(engine, commands, results).run()


def _send(conn: Connection, message: object) -> bool:
    try:
        conn.send(message)
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return False  # the client is gone


class _Loop:
    def __init__(self, engine: Any, commands: Connection, results: Connection) -> None:
        self.engine = engine
        self.commands = commands
        self.results = results
        self.steps: list[StepRecord] = []
        self.finished: list[RequestRecord] = []
        engine.metrics.step_listeners.append(self.steps.append)
        engine.metrics.request_listeners.append(self.finished.append)
        self.running = True

    def run(self) -> None:
        engine = self.engine
        try:
            while self.running:
                busy = engine.has_unfinished_requests()
                # Idle: block until a command (or the client's end of the pipe closes). Busy: take
                # whatever has arrived, then step.
                changed = self._take_commands(block=not busy)
                if not self.running:
                    break
                if engine.has_unfinished_requests():
                    message = StepMessage(engine.step(), self.steps, self.finished, engine.load)
                elif changed:  # an abort of the last request, say: the load changed with no step
                    message = StepMessage(load=engine.load, finished=self.finished)
                else:
                    continue
                sent = _send(self.results, message)  # pickled here, so the lists can be reused
                self.steps.clear()
                self.finished.clear()
                if not sent:
                    return
        except BaseException:
            logger.exception("engine core loop died")
            _send(self.results, CoreDied(traceback.format_exc()))

    def _take_commands(self, block: bool) -> bool:
        """Apply every command waiting in the pipe (waiting for one first if ``block``)."""
        changed = False
        timeout = None if block else 0.0
        while self.running and self.commands.poll(timeout):
            try:
                command = self.commands.recv()
            except (EOFError, OSError):
                self.running = False  # the client is gone: nobody is left to serve
                break
            self._apply(command)
            changed = True
            timeout = 0.0
        return changed

    def _apply(self, command: object) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            try:
                engine.add_request(
                    command.request_id,
                    command.prompt,
                    command.params,
                    priority=command.priority,
                    resume_token_ids=command.resume_token_ids,
                    resume_by_index=command.resume_by_index,
                    indexes=command.indexes,
                    slo_ttft_s=command.slo_ttft_s,
                    slo_tpot_s=command.slo_tpot_s,
                )
                reply = Reply(command.seq)
            except Exception as exc:  # refused (bad input, queue full): the caller raises it
                reply = Reply(command.seq, error=exc)
            _send(self.results, reply)
        elif isinstance(command, AbortRequest):
            engine.abort_request(command.request_id)
        elif isinstance(command, Inspect):
            try:
                reply = Reply(command.seq, INSPECTIONS[command.what](engine))
            except Exception as exc:
                reply = Reply(command.seq, error=exc)
            _send(self.results, reply)
        elif isinstance(command, Shutdown):
            self.running = False
        else:
            raise TypeError(f"unknown engine core command {command!r}")
