"""Token events -> OpenAI response bodies: streaming chunks, whole responses, usage."""

from __future__ import annotations

import json
from typing import Any

from engine.outputs import ChoiceAccumulator
from engine.tokenizer import Tokenizer
from services.common.wire import DeltaEvent, DoneEvent, Kind
from services.gateway.tool_parser import CallDelta, ParsedCall, ToolCallStream, parse_tool_calls
from services.gateway.tools import CallStream, ToolMode, new_call_id, parse_call


class ResponseBuilder:
    """Formats one request's events; also accumulates them for a non-streaming response."""

    def __init__(
        self,
        kind: Kind,
        request_id: str,
        model: str,
        created: int,
        n: int,
        tokenizer: Tokenizer | None,
        logprobs: int | None = None,
        tools: ToolMode = None,
        echo: list[str] | None = None,
        tool_parser: str = "hermes",
        parallel_tool_calls: bool = True,
    ) -> None:
        self.kind = kind
        self.id = request_id
        self.model = model
        self.created = created
        self.n = n
        self.tokenizer = tokenizer
        self.logprobs = logprobs
        self.choices: ChoiceAccumulator[list[list[float]]] = ChoiceAccumulator(n)
        self._role_sent: set[int] = set()
        # Tool calls (tools.py): a forced call's text is the call; under auto, calls the model wrote are
        # parsed out of its text (tool_parser.py). Either way they are answered as tool_calls.
        self.tools = tools
        self.tool_parser = tool_parser  # the call format under auto (tool_parser.family_of)
        self.parallel_tool_calls = parallel_tool_calls  # False: a choice's first call only
        self._calls: dict[int, CallStream] = {}
        self._auto: dict[int, ToolCallStream] = {}
        self._sse_head: str | None = None  # "data: " and the chunk envelope up to its choices (sse)
        # Completions with echo: each prompt's text (n choices per prompt), sent before the choice's first
        # tokens; _echoed holds the choices that have had it.
        self.echo = echo
        self._echoed: set[int] = set()

    @property
    def object(self) -> str:
        return "text_completion" if self.kind == "completion" else "chat.completion"

    def add(self, ev: DeltaEvent) -> None:
        self.choices.add(ev.index, ev.token_ids, ev.text, ev.finish_reason, ev.stop_reason, ev.logprobs)

    # ---- streaming -------------------------------------------------------------------------
    def chunk(self, ev: DeltaEvent) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": ev.index}
        if self.kind == "completion":
            choice["text"] = self._echo(ev.index) + ev.text
            choice["logprobs"] = self._completion_logprobs(ev.token_ids, ev.logprobs or [])
        else:
            delta: dict[str, Any] = {"content": ev.text}
            if self.tools == "forced":
                delta = self._call_delta(ev)
            elif self.tools == "auto":
                delta = self._auto_delta(ev)
            if ev.index not in self._role_sent:
                self._role_sent.add(ev.index)
                delta = {"role": "assistant", **delta}
            choice["delta"] = delta
            choice["logprobs"] = self._chat_logprobs(ev.token_ids, ev.logprobs or [])
        choice["finish_reason"] = ev.finish_reason
        called = self.tools == "forced" or (ev.index in self._auto and self._auto[ev.index].calls > 0)
        if called and ev.finish_reason == "stop":
            choice["finish_reason"] = "tool_calls"
        if ev.finish_reason is not None:
            choice["stop_reason"] = ev.stop_reason
        return self._envelope([choice], chunk=True)

    def sse(self, ev: DeltaEvent) -> str:
        """One event as a server-sent event: ``sse_data(self.chunk(ev))``, byte for byte. A plain text
        delta (no logprobs, no tool calls, not the last of its choice, not a chat choice's first) is
        the common case, one per token: its chunk is filled into this request's envelope, encoded once,
        instead of built as dicts and encoded whole."""
        plain = ev.finish_reason is None and self.logprobs is None and self.tools is None
        plain = plain and (self.echo is None or ev.index in self._echoed)
        if not plain or (self.kind == "chat" and ev.index not in self._role_sent):
            return sse_data(self.chunk(ev))
        if self._sse_head is None:
            envelope = _dumps(self._envelope([], chunk=True))
            assert envelope.endswith("[]}")
            self._sse_head = "data: " + envelope[:-2]  # up to and with the choices' opening bracket
        text = _dumps(ev.text)
        if self.kind == "completion":
            return f'{self._sse_head}{{"index":{int(ev.index)},"text":{text}{_PLAIN_TAIL}'
        return f'{self._sse_head}{{"index":{int(ev.index)},"delta":{{"content":{text}}}{_PLAIN_TAIL}'

    def _echo(self, index: int) -> str:
        """The prompt text to put before choice ``index``'s text, once; "" without echo. Choices are
        numbered prompt by prompt (fanout.py): with 2 prompts and n = 3 (self.n = 6), choices 0-2 echo
        prompt 0 and 3-5 prompt 1, i.e. prompt ``index * 2 // 6``."""
        if self.echo is None or index in self._echoed:
            return ""
        self._echoed.add(index)
        return self.echo[index * len(self.echo) // self.n]

    def _call_delta(self, ev: DeltaEvent) -> dict[str, Any]:
        call = self._calls.setdefault(ev.index, CallStream())
        entry = call.feed(ev.text, final=ev.finish_reason is not None)
        return {"content": None, "tool_calls": [entry]} if entry is not None else {}

    def _auto_delta(self, ev: DeltaEvent) -> dict[str, Any]:
        """Content as it streams, a possible call marker held back; calls as OpenAI streams them: a call's
        first entry has its index, id, type and name, the next ones fragments of its arguments."""
        stream = self._auto.setdefault(ev.index, ToolCallStream(self.tool_parser))
        pieces = stream.feed(ev.text, final=ev.finish_reason is not None)
        text = "".join(p for p in pieces if isinstance(p, str))
        entries: list[dict[str, Any]] = []
        for p in pieces:
            if not isinstance(p, CallDelta) or (not self.parallel_tool_calls and p.index > 0):
                continue  # text, or a call after the first where only one is answered
            if p.name is None and entries and entries[-1]["index"] == p.index:
                entries[-1]["function"]["arguments"] += p.arguments  # one entry per call and chunk
            elif p.name is not None:
                function = {"name": p.name, "arguments": p.arguments}
                entries.append(
                    {"index": p.index, "id": new_call_id(), "type": "function", "function": function}
                )
            else:
                entries.append({"index": p.index, "function": {"arguments": p.arguments}})
        if not entries:
            return {"content": text}
        return {"content": text or None, "tool_calls": entries}

    def usage_chunk(self, done: DoneEvent) -> dict[str, Any]:
        return {**self._envelope([], chunk=True), "usage": done_usage(done)}

    # ---- whole response --------------------------------------------------------------------
    def response(self, done: DoneEvent) -> dict[str, Any]:
        choices = []
        for i in range(self.n):
            c = self.choices.choice(i)
            choices.append(
                self._choice(
                    i, self._echo(i) + c.text, c.finish_reason, c.stop_reason, c.token_ids, c.logprobs
                )
            )
        add_prompt_logprobs(choices, done.prompt_logprobs)
        body = self._envelope(choices, chunk=False)
        body["usage"] = done_usage(done)
        return body

    def _choice(
        self, index: int, text: str, finish: str | None, stop_reason: Any, ids: list[int], lps: list[Any]
    ) -> dict[str, Any]:
        if self.kind == "completion":
            lp: Any = self._completion_logprobs(ids, lps)
            return {
                "index": index,
                "text": text,
                "logprobs": lp,
                "finish_reason": finish,
                "stop_reason": stop_reason,
            }
        message, finish = chat_message(text, finish, self.tools, self.tool_parser, self.parallel_tool_calls)
        lp = self._chat_logprobs(ids, lps)
        return {
            "index": index,
            "message": message,
            "logprobs": lp,
            "finish_reason": finish,
            "stop_reason": stop_reason,
        }

    def _envelope(self, choices: list[dict[str, Any]], *, chunk: bool) -> dict[str, Any]:
        obj = self.object + (".chunk" if chunk and self.kind == "chat" else "")
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    # ---- logprobs --------------------------------------------------------------------------
    def _token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion_logprobs(self, ids: list[int], lps: list[list[list[float]]]) -> dict[str, Any] | None:
        if self.logprobs is None or not ids:
            return None
        tokens = [self._token_str(t) for t in ids]
        chosen = [_lookup(pairs, t) for t, pairs in zip(ids, lps, strict=False)]
        top = [{self._token_str(int(p[0])): p[1] for p in pairs[: self.logprobs]} for pairs in lps]
        offsets, pos = [], 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        return {"tokens": tokens, "token_logprobs": chosen, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, ids: list[int], lps: list[list[list[float]]]) -> dict[str, Any] | None:
        if self.logprobs is None or not ids:
            return None
        content = []
        for token_id, pairs in zip(ids, lps, strict=False):
            tok = self._token_str(token_id)
            content.append(
                {
                    "token": tok,
                    "logprob": _lookup(pairs, token_id),
                    "bytes": list(tok.encode()),
                    "top_logprobs": [
                        {"token": s, "logprob": p[1], "bytes": list(s.encode())}
                        for p in pairs[: self.logprobs]
                        for s in [self._token_str(int(p[0]))]
                    ],
                }
            )
        return {"content": content}


def chat_message(
    text: str, finish: str | None, tools: ToolMode, parser: str = "hermes", parallel: bool = True
) -> tuple[dict[str, Any], str | None]:
    """A whole chat answer's message and finish reason: its tool calls as ``tool_calls`` (finish
    "tool_calls" where the model stopped on its own), else its text as content. Synchronous responses and
    job results are both built here."""
    calls: list[ParsedCall] = []
    content: str | None = text
    if tools == "forced" and finish == "stop":
        call = parse_call(text)
        if call is not None:
            content, calls = None, [ParsedCall(*call)]
    elif tools == "auto" and finish in ("stop", "length"):
        content, calls = parse_tool_calls(text, parser)
        calls = calls if parallel else calls[:1]
    if not calls:
        return {"role": "assistant", "content": text}, finish
    message = {"role": "assistant", "content": content, "tool_calls": [_call(c) for c in calls]}
    return message, "tool_calls" if finish == "stop" else finish


def _call(call: ParsedCall) -> dict[str, Any]:
    function = {"name": call.name, "arguments": call.arguments}
    return {"id": new_call_id(), "type": "function", "function": function}


def _lookup(pairs: list[list[float]], token_id: int) -> float | None:
    return next((p[1] for p in pairs if int(p[0]) == token_id), None)


_PLAIN_TAIL = ',"logprobs":null,"finish_reason":null}]}\n\n'  # a plain delta's chunk, after its text


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def sse_data(obj: dict[str, Any]) -> str:
    """A server-sent event carrying ``obj`` as compact JSON (UTF-8 as is, not escaped)."""
    return f"data: {_dumps(obj)}\n\n"


def add_prompt_logprobs(choices: list[dict[str, Any]], per_prompt: list[Any] | None) -> None:
    """vLLM's ``prompt_logprobs`` on each choice: its prompt's (choices run n per prompt, in order)."""
    if not per_prompt or not choices:
        return
    n = max(len(choices) // len(per_prompt), 1)
    for i, choice in enumerate(choices):
        choice["prompt_logprobs"] = per_prompt[min(i // n, len(per_prompt) - 1)]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens served from the engine's prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def done_usage(done: DoneEvent) -> dict[str, Any]:
    return usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)


def record_tools(record: dict[str, str]) -> ToolMode:
    """How a job's result answers tool calls, as its record says (jobs_routes.py stores it)."""
    mode = record.get("tools")
    return "forced" if mode == "forced" else "auto" if mode == "auto" else None


def record_tool_reading(record: dict[str, str]) -> dict[str, Any]:
    """The call format and parallel_tool_calls of a job, as its record says (jobs_routes.py)."""
    parser = record.get("tool_parser") or "hermes"
    return {"tool_parser": parser, "parallel_tool_calls": record.get("parallel_tool_calls") != "0"}


def response_from_record(record: dict[str, str], request_id: str) -> dict[str, Any] | None:
    """The OpenAI response of a finished job, from the result the worker stored."""
    if "result" not in record:
        return None
    result = json.loads(record["result"])
    used = json.loads(record.get("usage", "{}"))
    kind: Kind = "chat" if record.get("kind") == "chat" else "completion"
    created = int(float(record.get("created", 0)))
    builder = ResponseBuilder(
        kind,
        request_id,
        record.get("model", ""),
        created,
        0,
        None,
        tools=record_tools(record),
        **record_tool_reading(record),
    )
    choices = [
        builder._choice(c["index"], c["text"], c.get("finish_reason"), c.get("stop_reason"), [], [])
        for c in result.get("choices", [])
    ]
    plp = result.get("prompt_logprobs")
    add_prompt_logprobs(choices, None if plp is None else [plp])
    body = builder._envelope(choices, chunk=False)
    details = used.get("prompt_tokens_details") or {}
    body["usage"] = usage(
        int(used.get("prompt_tokens", 0)),
        int(used.get("completion_tokens", 0)),
        int(details.get("cached_tokens", 0)),
    )
    return body
