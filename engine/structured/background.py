"""Grammars compiled off the engine's step loop.

The first constrained request used to stop every step for seconds: importing xgrammar, scanning the
vocabulary into its tokenizer info, then compiling the schema, all on the engine's thread. Here they run on
one helper thread. A request whose grammar is not ready waits (``Request.waiting_for_grammar``: the
scheduler passes it over, as vLLM's WAITING_FOR_FSM) while the others keep stepping; once its compile is
done it is admitted like any waiting request, or, if the compile failed, finished with the error (its
param included): it never held a KV block. A grammar already compiled (the cache is keyed by the spec's
hash) makes no request wait at all.

Nothing here imports xgrammar or torch on the engine's thread: ``grammar.py`` is imported by the helper.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.structured.spec import StructuredOutput, StructuredOutputError

if TYPE_CHECKING:
    from engine.request import Request
    from engine.structured.grammar import GrammarCompiler


@dataclass
class _Pending:
    future: Future[None]
    requests: list[Request]
    spec: StructuredOutput


def _compile(compiler: GrammarCompiler, spec: StructuredOutput) -> None:
    compiler.compile(spec)


class BackgroundCompiles:
    """The engine's grammar compiles in flight, keyed by the caller's request id (n > 1 shares one)."""

    # Tests replace this to hold a compile back (a slow schema, deterministically).
    compile_hook: Callable[[GrammarCompiler, StructuredOutput], None] = staticmethod(_compile)

    def __init__(self, config: EngineConfig) -> None:
        self._config = config
        self._pool: ThreadPoolExecutor | None = None  # started by the first constrained request
        self._compiler: GrammarCompiler | None = None  # set by the helper once built
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def submit(self, request_id: str, spec: StructuredOutput, requests: list[Request]) -> None:
        """Compile ``spec`` for ``requests`` (one caller's sequences); they wait unless it is compiled."""
        with self._lock:
            compiler = self._compiler
        if compiler is not None and compiler.has(spec):
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="inflight-grammar-compile")
        for request in requests:
            request.waiting_for_grammar = True
        future = self._pool.submit(self._build_and_compile, spec)
        self._pending[request_id] = _Pending(future, requests, spec)

    def _build_and_compile(self, spec: StructuredOutput) -> None:
        from engine.structured.grammar import compiler_for_engine

        compiler = compiler_for_engine(self._config)  # the first time: xgrammar's import and vocab scan
        with self._lock:
            self._compiler = compiler
        type(self).compile_hook(compiler, spec)

    def drop(self, request_id: str) -> None:
        """Forget a request that finished (aborted) while its grammar compiled; the compile still ends."""
        self._pending.pop(request_id, None)

    def ready(self) -> list[tuple[list[Request], StructuredOutputError | None]]:
        """The requests whose compile has ended, each with its error (None: compiled, may run now)."""
        done = [rid for rid, p in self._pending.items() if p.future.done()]
        results = []
        for rid in done:
            pending = self._pending.pop(rid)
            exc = pending.future.exception()
            error: StructuredOutputError | None = None
            if isinstance(exc, StructuredOutputError):
                error = exc
            elif exc is not None:  # the library failed in another way: still only this request's fault
                error = StructuredOutputError(f"the grammar could not be compiled: {exc}", pending.spec.param)
            if error is None:
                for request in pending.requests:
                    request.waiting_for_grammar = False
            results.append((pending.requests, error))
        return results

    def wait(self, timeout_s: float) -> None:
        """Block until a compile ends or ``timeout_s`` passes: for an engine with nothing else to run."""
        futures = [p.future for p in self._pending.values()]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
