"""EngineCoreClient: the caller's side of an engine core running in its own process.

It answers the calls ``InprocClient`` answers (the ``EngineClient`` interface of client.py: generate,
abort, load, tokenizer, metrics), from a torch-free process: the worker's Kafka, Redis and HTTP work then
never competes with the model step for a GIL, which measured +13% (SmolLM2) to +77% (a tiny model) on the
step inside a worker (``bench/step_overhead.py``). Commands are encoded on the event loop (a value that
cannot cross the pipe fails its own call) and three threads do the rest: a sender, so a full pipe never
blocks the event loop; a reader, which decodes the core's messages, fires the metric listeners with its
step and request records (as the core's own thread would in-process), runs the step's token ids through
the output processor (text, stop strings, n > 1 grouping: none of it on the core's process) and hands the
resulting outputs to the event loop in one callback; and a watchdog, which kills a core that has work and
stops stepping (``watchdog.py``). Anything unexpected in those threads marks the engine dead: every stream
fails, no call hangs.

What is bounded, and by what:
- the sender's queue: one ``AddRequest`` and at most one ``AbortRequest`` per stream (aborts of one
  request are coalesced; a request this client is not streaming is not sent one), plus one ``Inspect``
  per waiting caller; the number of streams is the caller's to bound (the worker's intake does).
- the callbacks on the event loop: at most ``_MAX_DISPATCHES`` steps' outputs queued; past that the
  reader waits, the pipe fills and the core blocks on its next send, so a late event loop slows the
  core instead of buffering its output (the watchdog does not count that wait against the core).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec

from engine.core.messages import (
    AbortRequest,
    Added,
    AddRequest,
    CoreDied,
    Inspect,
    Ready,
    Reply,
    SeqOutput,
    Shutdown,
    Step,
    StopSequence,
    client_codec,
)
from engine.core.output_processor import OutputProcessor
from engine.core.watchdog import EngineStalled, StallPolicy, StepClock
from engine.inputs import PromptLimits
from engine.metrics import EngineMetrics, SchedulerStats
from engine.output_stream import Stream, stream_outputs

if TYPE_CHECKING:
    from engine.inputs import EngineRequest
    from engine.outputs import RequestOutput
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_NO_LOAD = SchedulerStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0)
_MAX_DISPATCHES = 32  # steps of outputs waiting for the event loop before the reader stops reading

# What the sender sends: the encoded command, whether it waits for an answer, the request it aborts.
_Outgoing = tuple[bytes, bool, str | None]


class EngineCoreClient:
    def __init__(
        self,
        model: str,
        engine_args: Mapping[str, Any] | None = None,
        *,
        torch_threads: int | None = None,
        log_level: str = "INFO",
        setup: Callable[[Any], None] | None = None,
        stall: StallPolicy | None = None,
    ) -> None:
        self.model = model
        self.engine_args = dict(engine_args or {})
        self.torch_threads = torch_threads
        self.log_level = log_level
        self.setup = setup
        self.metrics = EngineMetrics()  # fed from the core's records; exporters attach here
        self.load: SchedulerStats = _NO_LOAD  # the core's load as of its last message
        self.tokenizer: Tokenizer | None = None
        self.prompt_limits = PromptLimits(None, None)  # the core's, once it is ready
        self.description = ""
        self.dead_error: BaseException | None = None
        self.clock = StepClock(stall or StallPolicy())
        self._codec = client_codec()  # encodes on the event loop, decodes on the reader thread
        self._streams: dict[str, Stream] = {}
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._num_unacknowledged = 0
        self._seq = itertools.count()
        self._outbox: queue.SimpleQueue[_Outgoing | None] = queue.SimpleQueue()
        self._aborting: set[str] = set()  # requests with an abort in the outbox
        # Requests sent and not yet taken, by the seq of their AddRequest: the reader thread hands each
        # to the output processor when the core's Added arrives, before any step can report it.
        self._adding: dict[int, tuple[EngineRequest, str | None]] = {}
        self.processor: OutputProcessor | None = None  # once the core is ready (it needs the tokenizer)
        self._dispatches = threading.BoundedSemaphore(_MAX_DISPATCHES)
        self._dead_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None  # multiprocessing's SpawnProcess
        self._commands: Connection | None = None
        self._results: Connection | None = None
        self._threads: list[threading.Thread] = []
        self._closing = False

    # ---- read from the event loop ---------------------------------------------------------
    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_unacknowledged(self) -> int:
        """Requests handed to ``generate`` that the core has not taken yet (the load does not show them)."""
        return self._num_unacknowledged

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def max_model_len(self) -> int:
        return self.prompt_limits.max_model_len or 0  # 0 until the core is ready

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Spawn the core and wait until its model is loaded (raises what its start-up raised)."""
        if self._proc is not None:
            return
        from engine.core.proc import run_engine_core  # the child imports torch, not this process

        self._loop = asyncio.get_running_loop()
        # spawn, not fork: this process has threads (the event loop's executors, OpenTelemetry's
        # exporters) that a fork would copy mid-state.
        ctx = multiprocessing.get_context("spawn")
        commands_out, commands_in = ctx.Pipe(duplex=False)
        results_out, results_in = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=run_engine_core,
            args=(self.model, self.engine_args, commands_out, results_in),
            kwargs={"torch_threads": self.torch_threads, "log_level": self.log_level, "setup": self.setup},
            name="inflight-engine-core",
            daemon=True,
        )
        self._proc.start()
        commands_out.close()  # the child's ends: closed here so its exit reads as EOF on ours
        results_in.close()
        self._commands, self._results = commands_in, results_out
        try:
            first = self._codec.decode(await asyncio.to_thread(results_out.recv_bytes))
        except EOFError:
            await asyncio.to_thread(self._proc.join, 5)
            raise RuntimeError(
                f"the engine core exited during start-up (exit code {self._proc.exitcode})"
            ) from None
        if isinstance(first, CoreDied):
            await asyncio.to_thread(self._proc.join, 5)
            raise RuntimeError(f"the engine core failed to start:\n{first.error}")
        if not isinstance(first, Ready):
            raise RuntimeError(f"the engine core's first message is not Ready: {first!r}")
        from engine.tokenizer import load_tokenizer  # the same checkpoint's tokenizer, loaded here

        self.tokenizer = await asyncio.to_thread(load_tokenizer, first.model_path)
        self.prompt_limits = first.limits
        self.processor = OutputProcessor(self.tokenizer, first.limits, self._stop_sequence)
        self.load = first.load
        self.description = first.description
        logger.info("engine core running in process %d: %s", self._proc.pid, first.description)
        threads = ((self._read, "reader"), (self._write, "sender"), (self._watch, "watchdog"))
        for target, name in threads:
            thread = threading.Thread(target=target, name=f"inflight-core-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    async def shutdown(self) -> None:
        if self._proc is None or self._closing:
            return
        self._closing = True
        self._outbox.put((self._codec.encode(Shutdown()), False, None))
        self._outbox.put(None)  # the sender's signal to stop
        await asyncio.to_thread(self._proc.join, 30)
        if self._proc.is_alive():
            logger.warning("the engine core did not stop within 30 s: killing it")
            self._proc.kill()
            await asyncio.to_thread(self._proc.join, 5)
        for thread in self._threads:
            await asyncio.to_thread(thread.join, 5)
        for conn in (self._commands, self._results):
            if conn is not None:
                conn.close()

    # ---- requests ------------------------------------------------------------------------------
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs. Leaving the iterator early (or cancelling) aborts the request."""
        request_id = request.request_id
        text = request.prompt if isinstance(request.prompt, str) else None

        async def send() -> None:
            if self._proc is None:
                await self.start()
            assert self.processor is not None
            # Counted from here until the core's answer: the load shows it only from then on.
            self._num_unacknowledged += 1
            try:
                if text is None:
                    prepared = self.processor.prepare(request)
                else:  # tokenizing text takes a while: off the event loop
                    prepared = await asyncio.to_thread(self.processor.prepare, request)

                def add(seq: int) -> AddRequest:
                    self._adding[seq] = (prepared, text)
                    return AddRequest(seq, prepared)

                await self._ask(add)
            finally:
                self._num_unacknowledged -= 1

        return stream_outputs(
            self._streams,
            request_id,
            send,
            lambda: self._send_abort(request_id),
            lambda: self.dead_error is not None,
        )

    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; the stream then ends with finish_reason "abort"."""
        if self.dead_error is not None:
            raise RuntimeError("the engine loop has died") from self.dead_error
        if request_id in self._streams:  # otherwise the core has no such request from this client
            self._send_abort(request_id)

    async def inspect(self, what: str) -> Any:
        """Ask the core a read-only question between steps (see ``engine.core.proc.INSPECTIONS``)."""
        return await self._ask(lambda seq: Inspect(seq, what))

    def _stop_sequence(self, request_id: str, index: int, stop: str) -> SeqOutput | None:
        """The output processor (on the reader thread) found a stop string: the core finishes the
        sequence, and its answer comes with a later step."""
        self._outbox.put((msgspec.msgpack.encode(StopSequence(request_id, index, stop)), False, None))
        return None

    def _send_abort(self, request_id: str) -> None:
        if request_id not in self._aborting:  # one abort of a request in the outbox at a time
            self._aborting.add(request_id)
            self._outbox.put((self._codec.encode(AbortRequest(request_id)), False, request_id))

    async def _ask(self, make: Callable[[int], msgspec.Struct]) -> Any:
        if self.dead_error is not None:
            raise RuntimeError("the engine loop has died") from self.dead_error
        assert self._loop is not None
        seq = next(self._seq)
        try:
            data = self._codec.encode(make(seq))
        except (TypeError, ValueError, msgspec.EncodeError) as exc:
            self._adding.pop(seq, None)
            raise ValueError(f"this request cannot be sent to the engine: {exc}") from exc
        reply: asyncio.Future[Any] = self._loop.create_future()
        self._replies[seq] = reply
        self._outbox.put((data, True, None))
        try:
            return await reply
        finally:
            self._replies.pop(seq, None)
            self._adding.pop(seq, None)

    # ---- the threads ---------------------------------------------------------------------------
    def _write(self) -> None:
        assert self._commands is not None
        try:
            while (item := self._outbox.get()) is not None:
                data, asks, aborts = item
                if aborts is not None:
                    self._aborting.discard(aborts)
                if asks:
                    self.clock.on_sent(time.monotonic())
                try:
                    self._commands.send_bytes(data)
                except (BrokenPipeError, ConnectionResetError, OSError):
                    return  # the core is gone; the reader reports it
        except BaseException as exc:
            logger.exception("the engine core's sender failed")
            self._died(RuntimeError(f"the engine core's sender failed: {exc!r}"))

    def _read(self) -> None:
        try:
            self._read_forever()
        except BaseException as exc:
            # A message it cannot decode, a listener that raised: never a silent, hanging client.
            logger.exception("the engine core's reader failed")
            self._died(RuntimeError(f"the engine core's reader failed: {exc!r}"))

    def _read_forever(self) -> None:
        assert self._results is not None and self._loop is not None
        loop = self._loop
        while True:
            try:
                raw = self._results.recv_bytes()
            except (EOFError, OSError):
                if self._closing:
                    return
                self._proc.join(5)
                code = self._proc.exitcode
                self._died(RuntimeError(f"the engine core process exited (exit code {code})"))
                return
            now = time.monotonic()
            message = self._codec.decode(raw)
            if isinstance(message, Step):
                self._on_step(message, now)
            elif isinstance(message, Added):
                added = self._adding.pop(message.seq, None)
                if added is not None and self.processor is not None:
                    self.processor.add(*added)
                self.load = message.load  # before the answer: the request is never counted nowhere
                self.clock.on_answer(now, core_busy=True)
                loop.call_soon_threadsafe(self._resolve, message.seq, None, None)
            elif isinstance(message, Reply):
                self.clock.on_answer(now, core_busy=None)
                error = None if message.error is None else message.error.exception()
                loop.call_soon_threadsafe(self._resolve, message.seq, message.value, error)
            elif isinstance(message, CoreDied):
                logger.error("the engine core died:\n%s", message.error)
                self._died(RuntimeError(f"the engine core died: {message.error.strip().splitlines()[-1]}"))
                return
            else:
                raise TypeError(f"unexpected message from the engine core: {message!r}")

    def _on_step(self, message: Step, now: float) -> None:
        self.clock.on_step(now, len(message.steps), message.busy)
        for step in message.steps:
            self.metrics.on_step(step)
        for record in message.finished:
            self.metrics.on_request_record(record)
        if message.load is not None:
            self.load = message.load
        if not message.outputs or self.processor is None:
            return
        # Text, stop strings and n > 1 grouping run here, on this thread: never on the core's.
        outputs = self.processor.process(message.outputs)
        if not outputs:
            return
        if not self._dispatches.acquire(blocking=False):
            self.clock.pause(True)  # the event loop is behind: wait for it, not the core
            while not self._dispatches.acquire(timeout=1.0):
                if self._closing or self.dead_error is not None:
                    return
            self.clock.pause(False)
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _watch(self) -> None:
        """Kill a core that has work and has sent nothing within its bound (see ``watchdog.py``)."""
        try:
            while not self._closing and self.dead_error is None:
                time.sleep(self.clock.policy.tick_s)
                waited = self.clock.overdue(time.monotonic())
                if waited is None or self._closing:
                    continue
                bound = self.clock.bound()
                logger.error(
                    "the engine core (process %s) has had work and sent nothing for %.1f s (bound %.1f s): "
                    "killing it",
                    self.pid,
                    waited,
                    bound,
                )
                # Marked first: its requests fail with the stall as the reason, not the kill's exit code.
                self._died(
                    EngineStalled(f"the engine core stalled: nothing for {waited:.1f}s (bound {bound:.1f}s)")
                )
                try:
                    self._proc.kill()
                except Exception:
                    logger.exception("killing the stalled engine core (process %s) failed", self.pid)
                return
        except BaseException as exc:
            logger.exception("the engine core's watchdog failed")
            self._died(RuntimeError(f"the engine core's watchdog failed: {exc!r}"))

    # ---- on the event loop ---------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        try:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put_nowait(out)
        finally:
            self._dispatches.release()

    def _resolve(self, seq: int, value: Any, error: BaseException | None) -> None:
        future = self._replies.get(seq)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def _died(self, error: BaseException) -> None:
        """From any thread: every stream and waiting call fails, as with a dead engine thread. The first
        reason stays (a stall, then the kill's EOF, reads as the stall)."""
        with self._dead_lock:
            if self.dead_error is not None:
                return
            self.dead_error = error
        assert self._loop is not None

        def fail_all() -> None:
            for stream in self._streams.values():
                stream.put_nowait(error)
            for future in self._replies.values():
                if not future.done():
                    future.set_exception(RuntimeError("the engine loop has died"))

        with contextlib.suppress(RuntimeError):  # the event loop is already closed: nobody to tell
            self._loop.call_soon_threadsafe(fail_all)
