"""From an API body to what the engine runs: prompt token ids and sampling parameters.

With the checkpoint the gateway prepares the prompt (``engine.inputs.prepare_prompt``, the rule every
edge shares: torch-free) so it can refuse a bad one before anything is enqueued, and so the Kafka key
can be the prompt's first block. Without it the text goes on and the worker prepares it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.inputs import (
    ModelContext,
    PromptError,
    PromptLimits,
    check_context_length,
    check_message_count,
    check_prompt_text,
    prepare_prompt,
)
from engine.models.gguf import is_gguf, local_tokenizer_files
from engine.sampling_params import SamplingParams
from engine.structured.spec import StructuredOutput
from engine.tokenizer import Tokenizer, load_tokenizer
from services.common.settings import Settings
from services.common.wire_sampling import WireSampling
from services.gateway import chat_template
from services.gateway.errors import APIError
from services.gateway.fields import check_fields
from services.gateway.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, _Sampling
from services.gateway.tool_parser import family_of
from services.gateway.tools import plan_tools, response_format_spec, tools_message


@dataclass(frozen=True)
class ModelInfo:
    name: str
    max_model_len: int | None  # None: unknown here, the worker checks
    vocab_size: int | None
    tokenizer: Tokenizer | None
    # The checkpoint's generation_config.json sampling values (SAMPLING_DEFAULTS), used where a request
    # leaves the field unset, as vLLM does by default.
    sampling_defaults: dict[str, float] = dataclasses.field(default_factory=dict)
    tool_parser: str = "auto"  # INFLIGHT_TOOL_PARSER: how calls under "auto" are read back
    max_messages: int | None = None  # INFLIGHT_MAX_MESSAGES
    max_grammar_bytes: int | None = None  # INFLIGHT_MAX_GRAMMAR_BYTES

    @property
    def limits(self) -> PromptLimits:
        return PromptLimits(self.max_model_len, self.vocab_size, self.max_messages)


def load_model_info(settings: Settings) -> ModelInfo:
    """The model's facts from its directory. Without one (the chart's default keeps the checkpoint off the
    gateway), the gateway forwards text and the worker tokenizes and checks the length."""
    config: dict[str, Any] = {}
    tokenizer = None
    defaults: dict[str, float] = {}
    if settings.model and (Path(settings.model).is_dir() or is_gguf(settings.model)):
        path = local_tokenizer_files(settings.model)  # a GGUF: its config and tokenizer, no weights
        if (path / "config.json").is_file():
            config = json.loads((path / "config.json").read_text())
        tokenizer = load_tokenizer(path)
        if tokenizer is not None and settings.chat_template:  # the operator's template over the checkpoint's
            tokenizer.chat_template = Path(settings.chat_template).read_text(encoding="utf-8")
        defaults = sampling_defaults(path / "generation_config.json")
    requested = settings.max_model_len or settings.engine_args.get("max_model_len")
    requested = int(requested) if requested else None
    # With the model's config, the engine's own rule (a value the engine would refuse fails here too).
    max_len = ModelContext.from_config(config).max_model_len(requested) if config else requested
    vocab = config.get("vocab_size")
    vocab_size = int(vocab) if vocab else None
    return ModelInfo(
        settings.model_name,
        max_len,
        vocab_size,
        tokenizer,
        defaults,
        settings.tool_parser,
        settings.max_messages,
        settings.max_grammar_bytes,
    )


# generation_config.json keys applied as a request's defaults (vLLM's list, but max_new_tokens: a length
# default stays this server's own, the room left in the context for chat and 16 for completions).
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(path: Path) -> dict[str, float]:
    """The checkpoint's sampling defaults; {} without the file. A value of the wrong type is skipped; one
    out of range stops the gateway here (ValueError), not every request later."""
    if not path.is_file():
        return {}
    config = json.loads(path.read_text())
    found = {
        k: int(v) if k == "top_k" else float(v)
        for k in SAMPLING_DEFAULTS
        for v in [config.get(k)]
        if isinstance(v, int | float) and not isinstance(v, bool)
    }
    SamplingParams(**found)  # type: ignore[arg-type]
    return found


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
    echo: str | None = None  # completions with echo: the prompt text the response repeats
    tool_parser: str = "hermes"  # chat under tool_choice auto: the call format (tool_parser.py)
    parallel_tool_calls: bool = True  # False: only a choice's first call is answered


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, code="invalid_value", param=param)


def prepare_completion(req: CompletionRequest, info: ModelInfo) -> Prepared:
    check_fields(req)
    if req.suffix:
        raise _bad("suffix is not supported", "suffix")
    if req.echo and req.logprobs is not None:
        raise _bad("echo with logprobs needs prompt logprobs, which the engine does not compute", "echo")
    if req.best_of is not None and req.best_of != req.n:
        raise _bad("best_of must equal n (no server-side ranking)", "best_of")
    structured = response_format_spec(req)
    prompt: Any = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:  # the route splits a batch (split_prompts); a job takes one prompt
            raise _bad("a job takes one prompt (send a batch of them as separate jobs)", "prompt")
        prompt = prompt[0]
    ids = _prompt_ids(info, req.max_tokens, prompt=prompt)
    text = prompt if isinstance(prompt, str) and not ids else None  # the worker prepares it
    prepared = _finish(req, info, ids, req.max_tokens, req.logprobs, text=text, structured=structured)
    if req.echo:
        # The prompt as the response repeats it: the text as sent, or the token ids decoded.
        if isinstance(prompt, str):
            echoed = prompt
        elif info.tokenizer is not None:
            echoed = info.tokenizer.decode(ids, skip_special_tokens=False)
        else:
            raise _bad("echo of a token-id prompt needs the tokenizer on the gateway", "echo")
        prepared = dataclasses.replace(prepared, echo=echoed)
    return prepared


# A batched prompt runs as this many engine requests at most (each is admitted and queued on its own).
MAX_PROMPTS = 64


def split_prompts(req: CompletionRequest) -> list[CompletionRequest]:
    """A completions body per prompt: several for a batch (a list of strings or of token-id lists),
    else the body itself. Each is prepared and run on its own; fanout.py merges their answers."""
    prompt = req.prompt
    if not (isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], str | list)):
        return [req]
    if len(prompt) > MAX_PROMPTS:
        raise _bad(f"a request takes at most {MAX_PROMPTS} prompts", "prompt")
    return [req.model_copy(update={"prompt": one}) for one in prompt]


def _prompt_ids(
    info: ModelInfo,
    max_tokens: int | None,
    *,
    prompt: str | list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The prompt prepared here (token ids, or text and a tokenizer); [] for text this gateway cannot
    tokenize, after the checks it can make. A refused prompt is OpenAI's 400, naming the field."""
    try:
        if info.tokenizer is None and (messages is not None or isinstance(prompt, str)):
            if isinstance(prompt, str):
                check_prompt_text(prompt)
            if info.max_model_len is not None:  # the prompt's length is the worker's to check
                check_context_length(0, info.max_model_len, max_tokens)
            return []
        return prepare_prompt(
            prompt,
            info.limits,
            info.tokenizer,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            max_tokens=max_tokens,
        )
    except PromptError as exc:
        raise _bad(str(exc), exc.param) from None


def prepare_chat(req: ChatCompletionRequest, info: ModelInfo) -> Prepared:
    check_fields(req)
    plan = plan_tools(req.tools, req.tool_choice)
    structured = response_format_spec(req)
    if plan.spec is not None and structured is not None:
        raise _bad("a forced tool call cannot also follow a response_format", "response_format")
    structured = plan.spec or structured
    try:  # checked here even where the worker renders them: it costs nothing to refuse them early
        check_message_count(len(req.messages), info.limits)
    except PromptError as exc:
        raise _bad(str(exc), exc.param) from None
    messages = chat_messages(req.messages)
    # Tools go to a template that renders them (and calls come back in its family's format); else one
    # system message lists them and asks for Hermes blocks. INFLIGHT_TOOL_PARSER, unless "auto", decides
    # the format calls are read in whatever the template.
    template_tools = plan.render if plan.render and chat_template.takes_tools(info.tokenizer) else None
    parser = (
        family_of(info.tokenizer.chat_template if info.tokenizer else None) if template_tools else "hermes"
    )
    parser = parser if info.tool_parser == "auto" else info.tool_parser
    if plan.render and not template_tools:
        messages = with_tools_message(messages, plan.render)
    max_tokens = req.max_completion_tokens or req.max_tokens
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if template_tools or req.chat_template_kwargs:
        ids = chat_template.render(
            info.tokenizer,
            info.limits,
            messages,
            add_generation_prompt=req.add_generation_prompt,
            max_tokens=max_tokens,
            tools=template_tools,
            kwargs=req.chat_template_kwargs,
        )
    else:
        ids = _prompt_ids(
            info, max_tokens, messages=messages, add_generation_prompt=req.add_generation_prompt
        )
    if plan.render and parser in ("mistral", "llama3_json"):
        # Mistral's [TOOL_CALLS] and Llama's <|python_tag|> are special tokens: keep them in the text.
        req = req.model_copy(update={"skip_special_tokens": False})
    prepared = _finish(
        req,
        info,
        ids,
        max_tokens,
        logprobs,
        messages=None if ids else messages,  # no tokenizer here: the worker renders them
        add_generation_prompt=req.add_generation_prompt,
        structured=structured,
        tool_calls=plan.calls,
    )
    return dataclasses.replace(
        prepared, tool_parser=parser, parallel_tool_calls=req.parallel_tool_calls is not False
    )


def logit_bias(raw: dict[str, float] | None, vocab: int | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as JSON keys) as the engine takes it: ids checked against the
    vocabulary where it is known, biases clamped to [-100, 100] as OpenAI clamps them."""
    if not raw:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise _bad(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        token = int(key)
        if vocab is not None and token >= vocab:
            raise _bad(f"logit_bias token {token} is not below the vocabulary size {vocab}", "logit_bias")
        bias[token] = min(100.0, max(-100.0, value))
    return bias


def with_tools_message(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with the tools listed in the system message (for a template that renders none)."""
    listing = tools_message(tools)
    if messages[0]["role"] == "system":
        return [
            {**messages[0], "content": f"{messages[0]['content']}\n\n{listing['content']}"},
            *messages[1:],
        ]
    return [listing, *messages]


def chat_messages(given: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the chat template gets them (a chat request's and ``/tokenize``'s)."""
    # Text parts joined into one string, None as "": what every chat template can render.
    messages: list[dict[str, Any]] = [
        {
            "role": m.role,
            "content": m.content if isinstance(m.content, str) else "".join(p.text for p in m.content or []),
        }
        | ({"name": m.name} if m.name else {})
        for m in given
    ]
    for m, out in zip(given, messages, strict=True):
        if m.tool_calls and not out["content"]:
            # An earlier call, in the shape this server asks the model to write one.
            out["content"] = "\n".join(
                "<tool_call>"
                + json.dumps({"name": f.get("name"), "arguments": _arguments(f.get("arguments"))})
                + "</tool_call>"
                for call in m.tool_calls
                for f in [call.get("function") or {}]
            )
    return messages


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
    # The prompt is prepared already (_prompt_ids): ids, or the text or messages the worker prepares.
    bound = info.max_grammar_bytes
    if structured is not None and bound is not None and len(structured.value.encode()) > bound:
        size = len(structured.value.encode())
        raise _bad(
            f"the {structured.kind} is {size} bytes, over the {bound} this service compiles", structured.param
        )
    vocab = info.vocab_size
    if vocab is not None and req.stop_token_ids and max(req.stop_token_ids) >= vocab:
        raise _bad(f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids")
    if req.prompt_logprobs is not None and req.stream:
        # They are known once the prompt is computed but travel with the request's end (DoneEvent).
        raise _bad("prompt_logprobs is not supported with stream", "prompt_logprobs")
    room = None if info.max_model_len is None else info.max_model_len - len(ids)
    fields: dict[str, Any] = {
        "n": req.n,
        **info.sampling_defaults,  # the checkpoint's, where the request leaves a field unset (below)
        "temperature": info.sampling_defaults.get("temperature", 1.0)
        if req.temperature is None
        else req.temperature,
        "top_p": info.sampling_defaults.get("top_p", 1.0) if req.top_p is None else req.top_p,
        "seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "max_tokens": max_tokens if max_tokens is not None or not ids else room,
        "min_tokens": req.min_tokens,
        "stop": [req.stop] if isinstance(req.stop, str) else list(req.stop or []),
        "stop_token_ids": list(req.stop_token_ids or []),
        "ignore_eos": req.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": req.prompt_logprobs,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "structured": structured,
        "logit_bias": logit_bias(req.logit_bias, vocab),
    }
    for name in ("top_k", "min_p", "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            fields[name] = value
    try:
        params = SamplingParams(**fields)
    except ValueError as exc:
        raise _bad(str(exc)) from None
    session = req.session_id or req.prompt_cache_key or req.user
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
