"""From an API body to what the engine runs: prompt token ids and sampling parameters.

The gateway tokenizes (torch-free ``engine.tokenizer``) so it can refuse a prompt longer than the
model's context before anything is enqueued, and so the Kafka key can be the prompt's first block.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.inputs import ContextLengthError, check_context_length
from engine.models.gguf import is_gguf, local_tokenizer_files
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from engine.tokenizer import Tokenizer, load_tokenizer
from services.common.settings import Settings
from services.common.wire_sampling import WireSampling
from services.gateway.errors import APIError
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, _Sampling
from services.gateway.tools import plan_tools, response_format_spec, tools_message


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int | None  # None: unknown here, the worker checks
    vocab_size: int | None
    tokenizer: Tokenizer | None


def load_model_info(settings: Settings) -> ModelInfo:
    """The model's facts from its directory. Without one (the chart's default keeps the checkpoint off the
    gateway), the gateway forwards text and the worker tokenizes and checks the length."""
    config: dict[str, Any] = {}
    tokenizer = None
    if settings.model and (Path(settings.model).is_dir() or is_gguf(settings.model)):
        path = local_tokenizer_files(settings.model)  # a GGUF: its config and tokenizer, no weights
        if (path / "config.json").is_file():
            config = json.loads((path / "config.json").read_text())
        tokenizer = load_tokenizer(path)
    max_len = settings.max_model_len or settings.engine_args.get("max_model_len")
    max_len = max_len or config.get("max_position_embeddings")
    vocab = config.get("vocab_size")
    return ModelInfo(
        settings.model_name, int(max_len) if max_len else None, int(vocab) if vocab else None, tokenizer
    )


@dataclass(frozen=True)
class Prepared:
    prompt_token_ids: list[int]  # empty when the gateway has no tokenizer: then text or messages
    params: WireSampling  # already validated
    session: str | None
    priority: int = 0
    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True  # for messages the worker renders
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    tool_calls: bool = False  # the output is a constrained tool call: answer with tool_calls


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, code="invalid_value", param=param)


def prepare_completion(req: CompletionRequest, info: ModelInfo) -> Prepared:
    if req.suffix:
        raise _bad("suffix is not supported", "suffix")
    if req.echo:
        raise _bad("echo is not supported", "echo")
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of must equal n (no server-side ranking)", "best_of")
    structured = response_format_spec(req)
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise _bad("send one prompt per request (batched prompts are not supported)", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if info.tokenizer is None:
            if not prompt:
                raise _bad("the prompt is empty", "prompt")
            return _finish(req, info, [], req.max_tokens, req.logprobs, text=prompt, structured=structured)
        _refuse_clearly_too_long(len(prompt), info)
        ids = info.tokenizer.encode(prompt, add_special_tokens=True)
    else:
        ids = [int(t) for t in prompt]
    return _finish(req, info, ids, req.max_tokens, req.logprobs, structured=structured)


def _refuse_clearly_too_long(num_chars: int, info: ModelInfo) -> None:
    """Refuse text that cannot fit the context before paying to tokenize it (megabytes take seconds).

    No token is longer than the vocabulary's longest token string, so the text has at least
    num_chars / that many tokens; when even that exceeds the context, the answer is known already.
    """
    if info.tokenizer is None or info.max_model_len is None:
        return
    per_token = _max_token_chars(info.tokenizer)
    if num_chars > info.max_model_len * per_token:
        raise _bad(
            f"This model's maximum context length is {info.max_model_len} tokens; this prompt's "
            f"{num_chars} characters are at least {num_chars // per_token} tokens. Shorten the prompt.",
            "prompt",
        )


@functools.cache
def _max_token_chars(tokenizer: Tokenizer) -> int:
    # Byte-level token strings spell each byte as one character: an over-estimate, which is safe here.
    tokens = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
    return max(1, max((len(t) for t in tokens if t), default=1))


def prepare_chat(req: ChatCompletionRequest, info: ModelInfo) -> Prepared:
    plan = plan_tools(req.tools, req.tool_choice)
    structured = response_format_spec(req)
    if plan.spec is not None and structured is not None:
        raise _bad("a forced tool call cannot also follow a response_format", "response_format")
    structured = plan.spec or structured
    # Text parts joined into one string, None as "": what every chat template can render.
    messages: list[dict[str, Any]] = [
        {
            "role": m.role,
            "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or []),
        }
        | ({"name": m.name} if m.name else {})
        for m in req.messages
    ]
    for m, out in zip(req.messages, messages, strict=True):
        if m.tool_calls and not out["content"]:
            # An earlier call, in the shape this server asks the model to write one.
            out["content"] = "\n".join(
                json.dumps({"name": f.get("name"), "arguments": _arguments(f.get("arguments"))})
                for call in m.tool_calls
                for f in [call.get("function") or {}]
            )
    if plan.render:
        # One system message lists the tools: templates differ in whether (and how) they render them.
        listing = tools_message(plan.render)
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{listing['content']}"}
        else:
            messages.insert(0, listing)
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if info.tokenizer is None:
        return _finish(
            req,
            info,
            [],
            max_tokens,
            logprobs,
            messages=messages,
            add_generation_prompt=req.add_generation_prompt,
            structured=structured,
            tool_calls=plan.calls,
        )
    _refuse_clearly_too_long(sum(len(str(m.get("content") or "")) for m in messages), info)
    try:
        text = info.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
    except Exception as exc:  # template code is the checkpoint's: any failure is the input's fault
        raise _bad(f"the chat template rejected these messages: {exc}", "messages") from None
    # The rendered template already holds bos and the other special tokens.
    ids = info.tokenizer.encode(text, add_special_tokens=False)
    return _finish(req, info, ids, max_tokens, logprobs, structured=structured, tool_calls=plan.calls)


def _arguments(raw: Any) -> Any:
    # OpenAI sends arguments as a JSON string; shown to the model as the object it stands for.
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def _finish(
    req: _Sampling,
    info: ModelInfo,
    ids: list[int],
    max_tokens: int | None,
    logprobs: int | None,
    *,
    text: str | None = None,
    messages: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    structured: StructuredOutput | None = None,
    tool_calls: bool = False,
) -> Prepared:
    if not ids and text is None and messages is None:
        raise _bad("the prompt is empty", "prompt")
    if req.logit_bias:
        raise _bad("logit_bias is not supported", "logit_bias")
    vocab = info.vocab_size
    if vocab is not None and ids and max(ids) >= vocab:
        raise _bad(f"prompt token ids must be below the vocabulary size {vocab}", "prompt")
    if vocab is not None and req.stop_token_ids and max(req.stop_token_ids) >= vocab:
        raise _bad(f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids")
    # Without a tokenizer the prompt's length is unknown here: only max_tokens is checked, the worker
    # checks the rest.
    room = None if info.max_model_len is None else info.max_model_len - len(ids)
    if info.max_model_len is not None:
        try:
            check_context_length(len(ids), info.max_model_len, max_tokens)
        except ContextLengthError as exc:
            raise _bad(str(exc), exc.param) from None
    fields: dict[str, Any] = {
        "n": req.n,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "max_tokens": max_tokens if max_tokens is not None or not ids else room,
        "min_tokens": req.min_tokens,
        "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "structured": structured,
    }
    for name in ("top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        raise _bad(str(exc)) from None
    session = req.session_id or req.user
    wire = WireSampling.from_params(params)
    return Prepared(
        ids,
        wire,
        session,
        req.priority,
        text,
        messages,
        add_generation_prompt,
        req.slo_ttft_ms,
        req.slo_tpot_ms,
        tool_calls,
    )
