"""EngineCoreClient: the caller's side of an engine core running in its own process.

It answers the calls ``AsyncLLMEngine`` answers (generate, abort, load, tokenizer, metrics), from a
torch-free process: the worker's Kafka, Redis and HTTP work then never competes with the model step
for a GIL, which measured +13% (SmolLM2) to +77% (a tiny model) on the step inside a worker
(``bench/step_overhead.py``). Two threads move messages: a sender, so a long prompt's pickling and a
full pipe never block the event loop, and a reader, which fires the metric listeners with the core's
step and request records (as the core's own thread would in-process) and hands each step's outputs
to the event loop in one callback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing
import queue
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

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
from engine.metrics import EngineMetrics, SchedulerStats
from engine.streams import Stream, stream_outputs

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

_NO_LOAD = SchedulerStats(0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0)


class EngineCoreClient:
    def __init__(
        self,
        model: str,
        engine_args: Mapping[str, Any] | None = None,
        *,
        torch_threads: int | None = None,
        log_level: str = "INFO",
        setup: Callable[[Any], None] | None = None,
    ) -> None:
        self.model = model
        self.engine_args = dict(engine_args or {})
        self.torch_threads = torch_threads
        self.log_level = log_level
        self.setup = setup
        self.metrics = EngineMetrics()  # fed from the core's records; exporters attach here
        self.load: SchedulerStats = _NO_LOAD  # the core's load as of its last message
        self.tokenizer: Tokenizer | None = None
        self.max_model_len = 0
        self.description = ""
        self.dead_error: BaseException | None = None
        self._streams: dict[str, Stream] = {}
        self._replies: dict[int, asyncio.Future[Any]] = {}
        self._seq = itertools.count()
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
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
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

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
            first = await asyncio.to_thread(results_out.recv)
        except EOFError:
            await asyncio.to_thread(self._proc.join, 5)
            raise RuntimeError(
                f"the engine core exited during start-up (exit code {self._proc.exitcode})"
            ) from None
        if isinstance(first, CoreDied):
            await asyncio.to_thread(self._proc.join, 5)
            raise RuntimeError(f"the engine core failed to start:\n{first.error}")
        assert isinstance(first, Ready), first
        from engine.tokenizer import load_tokenizer  # the same checkpoint's tokenizer, loaded here

        self.tokenizer = await asyncio.to_thread(load_tokenizer, first.model_path)
        self.max_model_len = first.max_model_len
        self.load = first.load
        self.description = first.description
        logger.info("engine core running in process %d: %s", self._proc.pid, first.description)
        for target, name in ((self._read, "inflight-core-reader"), (self._write, "inflight-core-sender")):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    async def shutdown(self) -> None:
        if self._proc is None or self._closing:
            return
        self._closing = True
        self._outbox.put(Shutdown())
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
    def generate(
        self,
        prompt: list[int] | str,
        params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        resume_token_ids: list[int] | None = None,
        resume_by_index: Mapping[int, Sequence[int]] | None = None,
        indexes: Sequence[int] | None = None,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs. Leaving the iterator early (or cancelling) aborts the request."""
        add = AddRequest(
            -1, request_id, prompt, params, priority, resume_token_ids, resume_by_index, indexes,
            slo_ttft_s, slo_tpot_s,
        )  # fmt: skip

        async def send() -> None:
            if self._proc is None:
                await self.start()
            await self._ask(lambda seq: dataclasses.replace(add, seq=seq))

        return stream_outputs(
            self._streams,
            request_id,
            send,
            lambda: self._outbox.put(AbortRequest(request_id)),
            lambda: self.dead_error is not None,
        )

    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; the stream then ends with finish_reason "abort"."""
        if self.dead_error is not None:
            raise RuntimeError("the engine loop has died") from self.dead_error
        self._outbox.put(AbortRequest(request_id))

    async def inspect(self, what: str) -> Any:
        """Ask the core a read-only question between steps (see ``engine.core.proc.INSPECTIONS``)."""
        return await self._ask(lambda seq: Inspect(seq, what))

    async def _ask(self, make: Callable[[int], object]) -> Any:
        if self.dead_error is not None:
            raise RuntimeError("the engine loop has died") from self.dead_error
        assert self._loop is not None
        seq = next(self._seq)
        reply: asyncio.Future[Any] = self._loop.create_future()
        self._replies[seq] = reply
        self._outbox.put(make(seq))
        try:
            return await reply
        finally:
            self._replies.pop(seq, None)

    # ---- the two threads -----------------------------------------------------------------------
    def _write(self) -> None:
        assert self._commands is not None
        while (message := self._outbox.get()) is not None:
            try:
                self._commands.send(message)
            except (BrokenPipeError, ConnectionResetError, OSError):
                return  # the core is gone; the reader reports it

    def _read(self) -> None:
        assert self._results is not None and self._loop is not None
        loop = self._loop
        while True:
            try:
                message = self._results.recv()
            except (EOFError, OSError):
                if self._closing:
                    return
                self._proc.join(5)
                code = self._proc.exitcode
                self._died(RuntimeError(f"the engine core process exited (exit code {code})"))
                return
            if isinstance(message, StepMessage):
                for step in message.steps:
                    self.metrics.on_step(step)
                for record in message.finished:
                    self.metrics.on_request_record(record)
                if message.load is not None:
                    self.load = message.load
                if message.outputs:
                    loop.call_soon_threadsafe(self._dispatch, message.outputs)
            elif isinstance(message, Reply):
                loop.call_soon_threadsafe(self._resolve, message)
            elif isinstance(message, CoreDied):
                logger.error("the engine core died:\n%s", message.error)
                self._died(RuntimeError(f"the engine core died: {message.error.strip().splitlines()[-1]}"))
                return

    # ---- on the event loop ---------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _resolve(self, reply: Reply) -> None:
        future = self._replies.get(reply.seq)
        if future is None or future.done():
            return
        if reply.error is not None:
            future.set_exception(reply.error)
        else:
            future.set_result(reply.value)

    def _died(self, error: BaseException) -> None:
        """From the reader thread: every stream and waiting call fails, as with a dead engine thread."""
        self.dead_error = error
        assert self._loop is not None

        def fail_all() -> None:
            for stream in self._streams.values():
                stream.put_nowait(error)
            for future in self._replies.values():
                if not future.done():
                    future.set_exception(RuntimeError("the engine loop has died"))

        self._loop.call_soon_threadsafe(fail_all)
