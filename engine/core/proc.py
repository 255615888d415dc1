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
import os
import signal
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from engine.core.messages import (
    AbortRequest,
    Added,
    AddRequest,
    Codec,
    CoreDied,
    Failure,
    Inspect,
    Ready,
    Reply,
    Shutdown,
    Step,
    StopSequence,
    core_codec,
    seq_of,
)
from engine.metrics import RequestRecord, StepRecord

logger = logging.getLogger(__name__)

EXIT_RANK_DIED = 70  # the core's exit code when a tensor-parallel rank died

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
    codec = core_codec()
    try:
        import torch

        if torch_threads:
            torch.set_num_threads(torch_threads)
        from engine.core.engine_core import EngineCore

        engine = EngineCore.from_engine_args(model, **engine_args)
        if setup is not None:
            setup(engine)
    except BaseException:
        # Start-up failures (a bad path, a bad argument) go to the client as text; it raises them.
        _send(results, codec, CoreDied(traceback.format_exc()))
        return
    config = engine.config
    description = (
        f"{config.model.architecture}, dtype {str(config.dtype).removeprefix('torch.')}, "
        f"{torch.get_num_threads()} torch threads"
    )
    ranks = engine.runner.ranks  # tensor parallelism: ranks 1..N-1
    if ranks is not None:
        description += f", tensor parallel over {config.tensor_parallel_size} ranks"
        # A rank that dies while this core idles would only be noticed at the next step: end the core
        # now, so its client fails it (the worker hands its requests back, readyz answers 503).
        ranks.watch(lambda message: os._exit(EXIT_RANK_DIED))
    from engine.platform.memory import freeze_heap

    # The model, torch and the engine's books live as long as this process: full collections that
    # walked them would stall a step by tens of milliseconds.
    freeze_heap()
    ready = Ready(config.model_path, engine.prompt_limits, engine.load, description)
    if not _send(results, codec, ready):
        return
    _Loop(engine, codec, commands, results).run()


def _send(conn: Connection, codec: Codec, message: Any) -> bool:
    data = codec.encode(message)  # before the pipe: a value that cannot be encoded raises here
    try:
        conn.send_bytes(data)
        return True
    except (BrokenPipeError, ConnectionResetError, EOFError):
        return False  # the client is gone


class _Loop:
    def __init__(self, engine: Any, codec: Codec, commands: Connection, results: Connection) -> None:
        self.engine = engine
        self.codec = codec
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
                    outputs = engine.step()
                    busy = engine.has_unfinished_requests()
                    message = Step(outputs, self.steps, self.finished, engine.load, busy)
                elif changed:  # an abort of the last request, say: the load changed with no step
                    message = Step(finished=self.finished, load=engine.load)
                else:
                    continue
                sent = _send(self.results, self.codec, message)  # encoded here: the lists can be reused
                self.steps.clear()
                self.finished.clear()
                if not sent:
                    return
        except BaseException:
            logger.exception("engine core loop died")
            _send(self.results, self.codec, CoreDied(traceback.format_exc()))

    def _take_commands(self, block: bool) -> bool:
        """Apply every command waiting in the pipe (waiting for one first if ``block``)."""
        changed = False
        timeout = None if block else 0.0
        while self.running and self.commands.poll(timeout):
            try:
                raw = self.commands.recv_bytes()
            except (EOFError, OSError):
                self.running = False  # the client is gone: nobody is left to serve
                break
            try:
                command = self.codec.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                # The client encodes with the same types, so this is a bug there: refuse that one
                # command (its asker gets the error), keep serving the others.
                logger.error("undecodable engine core command: %s", exc)
                seq = seq_of(raw)
                if seq is not None:
                    self._answer(Reply(seq, error=Failure("invalid", f"undecodable command: {exc}")))
                continue
            self._apply(command)
            changed = True
            timeout = 0.0
        return changed

    def _apply(self, command: object) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            request = command.request
            try:
                engine.add_request(request)
                answer: Added | Reply = Added(command.seq, request.request_id, engine.load)
            except Exception as exc:  # refused (bad input, queue full): the caller raises it
                answer = Reply(command.seq, error=Failure.of(exc))
            self._answer(answer)
        elif isinstance(command, AbortRequest):
            for ended in engine.abort_request(command.request_id):
                engine.defer(ended)
        elif isinstance(command, StopSequence):
            ended = engine.stop_sequence(command.request_id, command.index, command.stop)
            if ended is not None:
                engine.defer(ended)
        elif isinstance(command, Inspect):
            try:
                answer = Reply(command.seq, INSPECTIONS[command.what](engine))
            except Exception as exc:
                answer = Reply(command.seq, error=Failure.of(exc))
            self._answer(answer)
        elif isinstance(command, Shutdown):
            self.running = False
        else:
            raise TypeError(f"unknown engine core command {command!r}")

    def _answer(self, answer: Added | Reply) -> None:
        try:
            _send(self.results, self.codec, answer)
        except (TypeError, ValueError, msgspec.EncodeError) as exc:  # an answer that cannot be encoded
            seq = answer.seq
            _send(
                self.results, self.codec, Reply(seq, error=Failure("internal", f"unencodable answer: {exc}"))
            )
