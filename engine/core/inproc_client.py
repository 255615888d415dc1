"""InprocClient: the engine core on a thread of this process, streams on the caller's event loop.

The in-process twin of ``EngineCoreClient`` (``engine.core.client.make_client`` picks one): the
``LLMEngine`` it steps is the core plus its output processor, so text is made on the same thread,
after each step. Every engine mutation (add, abort, step) happens on the engine thread, so the engine
needs no locks; the event loop only enqueues commands and receives outputs. A caller's I/O (Kafka
heartbeats, Redis, HTTP) therefore never waits for a model step, though it shares the interpreter
with it: the worker runs the core in its own process unless ``INFLIGHT_ENGINE_PROCESS=false``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from engine.inputs import EngineRequest, PromptLimits
from engine.llm_engine import LLMEngine
from engine.metrics import EngineMetrics, SchedulerStats
from engine.output_stream import Stream, stream_outputs
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


class InprocClient:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: BaseException | None = None
        self._num_unacknowledged = 0

    @classmethod
    def from_engine_args(cls, model: str, **kwargs: Any) -> InprocClient:
        return cls(LLMEngine.from_engine_args(model, **kwargs))

    # ---- read from the event loop: the engine's last published load, never its live state ---
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def pid(self) -> int:
        return os.getpid()  # the loop is a thread of this process

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def prompt_limits(self) -> PromptLimits:
        return self.engine.prompt_limits

    @property
    def metrics(self) -> EngineMetrics:
        return self.engine.metrics

    @property
    def load(self) -> SchedulerStats:
        return self.engine.load

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_unacknowledged(self) -> int:
        """Requests handed to ``generate`` not yet added on the engine thread (``load`` shows them after)."""
        return self._num_unacknowledged

    # ---- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="inflight-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)
            self._thread = None

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                while True:
                    try:
                        self._commands.get_nowait()()
                    except queue.Empty:
                        break
                if engine.has_unfinished_requests():
                    for out in engine.step():
                        self._deliver(out.request_id, out)
                else:
                    self._wake.wait(_IDLE_WAIT_S)
                    self._wake.clear()
        except BaseException as exc:  # a dead loop must fail every stream, not hang them
            logger.exception("engine loop died")
            self.dead_error = exc
            for request_id in list(self._streams):
                self._deliver(request_id, exc)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(stream.put_nowait, item)

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the engine thread and await its result (exceptions propagate)."""
        if self.dead_error is not None:
            raise RuntimeError("the engine loop has died") from self.dead_error
        fut: Future[Any] = Future()

        def command() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:
                fut.set_exception(exc)

        self._commands.put(command)
        self._wake.set()
        return await asyncio.wrap_future(fut)

    # ---- requests --------------------------------------------------------------------------
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Stream delta outputs. Leaving the iterator early (or cancelling) aborts the request."""
        request_id = request.request_id

        async def add() -> None:
            if self._thread is None:
                await self.start()
            self._num_unacknowledged += 1
            try:
                await self._call(lambda: self.engine.add_request(request))
            finally:
                self._num_unacknowledged -= 1

        def abort() -> None:
            self._commands.put(lambda: self.engine.abort_request(request_id))
            self._wake.set()

        return stream_outputs(self._streams, request_id, add, abort, lambda: self.dead_error is not None)

    async def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; the stream then ends with finish_reason "abort"."""
        await self._call(lambda: self.engine.abort_request(request_id))

    async def run_on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """For tests and tools: inspect engine state between steps (e.g. kv.check_integrity)."""
        return await self._call(fn)


# The offline API's name for it (``engine.AsyncLLMEngine``, as vLLM's streaming front end is called).
AsyncLLMEngine = InprocClient
