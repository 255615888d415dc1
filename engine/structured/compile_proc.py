"""Grammar compiles in a child process that is killed when one runs past its time bound.

xgrammar cannot stop a compile once it has started, and some small schemas compile for minutes (deeply
nested alternatives, long alternations of bounded repeats). On the engine's compile thread such a compile
would hold a core for that long and every later constrained request would queue behind it. Here it runs
in a child process (``python -m engine.structured.compile_proc``); past ``timeout_s`` the child is
SIGKILLed, so the compile stops using CPU at once, and the request fails with a 400. The next compile
starts a fresh child (its start, xgrammar's import and the vocabulary read, costs about a second).

The protocol is one JSON line each way on the child's stdin and stdout: first the tokenizer's
``TokenizerInfo`` (serialized), answered ``{"ready": true}`` once the child can compile (its start is
not counted against a compile's bound: xgrammar imports torch, seconds on a busy host), then per compile
``{"kind", "value"}`` answered by
``{"ok": true, "grammar": <CompiledGrammar.serialize_json()>}`` or ``{"ok": false, "error": "..."}``.
The parent deserializes the grammar with its own ``TokenizerInfo``. Only xgrammar is imported here:
the child never loads torch's model code.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import xgrammar as xgr


def compile_spec(compiler: xgr.GrammarCompiler, kind: str, value: str) -> xgr.CompiledGrammar:
    """``StructuredOutput(kind, value)`` compiled by ``compiler`` (the one rule, here and in process)."""
    if kind == "json_object":
        # OpenAI's json_object is an object; xgrammar's builtin JSON grammar also takes arrays.
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "json_schema":
        return compiler.compile_json_schema(value, any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(value)
    if kind == "choice":
        # An EBNF alternation of the literal strings (JSON escapes are valid EBNF string escapes).
        choices = json.loads(value)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in choices))
    return compiler.compile_grammar(value)


class CompileTimeout(RuntimeError):
    """The compile ran past its bound; its process was killed."""


class CompileProcess:
    """One child compiling one spec at a time (calls are serialized by a lock)."""

    def __init__(self, tokenizer_info_json: str, timeout_s: float) -> None:
        self._info = tokenizer_info_json
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self.num_killed = 0

    def compile(self, kind: str, value: str) -> str:
        """The serialized compiled grammar; RuntimeError with xgrammar's message if it refuses the spec,
        CompileTimeout past the bound."""
        with self._lock:
            proc = self._child()
            assert proc.stdin is not None and proc.stdout is not None
            try:
                proc.stdin.write(json.dumps({"kind": kind, "value": value}).encode() + b"\n")
                proc.stdin.flush()
                ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
                line = proc.stdout.readline() if ready else b""
            except OSError:
                line = b""
            if not ready:
                self._kill()
                self.num_killed += 1
                raise CompileTimeout(f"the grammar did not compile within {self.timeout_s:g} s")
            if not line:  # the child died (out of memory, a crash in the library)
                self._kill()
                raise RuntimeError("the grammar compiler's process died compiling it")
            reply: dict[str, Any] = json.loads(line)
            if not reply["ok"]:
                raise RuntimeError(reply["error"])
            return str(reply["grammar"])

    def close(self) -> None:
        with self._lock:
            self._kill()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "engine.structured.compile_proc"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(self._info).encode() + b"\n")
            self._proc.stdin.flush()
            assert self._proc.stdout is not None
            if not self._proc.stdout.readline():
                self._kill()
                raise RuntimeError("the grammar compiler's process failed to start")
        return self._proc

    def start(self) -> None:
        """Start the child now (it is started by the first compile otherwise)."""
        with self._lock:
            self._child()

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for pipe in (self._proc.stdin, self._proc.stdout):
                if pipe is not None:
                    pipe.close()
            self._proc = None


def _serve() -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(json.loads(sys.stdin.readline()))
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    sys.stdout.write('{"ready": true}\n')
    sys.stdout.flush()
    for line in sys.stdin:
        request = json.loads(line)
        try:
            grammar = compile_spec(compiler, request["kind"], request["value"]).serialize_json()
            reply: dict[str, Any] = {"ok": True, "grammar": grammar}
        except Exception as exc:  # xgrammar reports bad schemas, regexes and grammars as RuntimeError
            reply = {"ok": False, "error": str(exc)}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve()
