"""The chat template with what a request adds to it: ``tools`` (HF's ``apply_chat_template(tools=...)``:
the template renders them its own way, where it takes them) and ``chat_template_kwargs`` (variables such as
Qwen3's ``enable_thinking``). Both need the template here, on the gateway: a gateway without the model's
files refuses them rather than drop them on the way to the worker."""

from __future__ import annotations

from typing import Any

from engine.inputs import PromptError, prepare_prompt
from engine.tokenizer import Tokenizer
from services.gateway.errors import APIError

# Variables a request cannot set through chat_template_kwargs: each has a field of its own.
RESERVED = frozenset({"messages", "add_generation_prompt", "tools", "bos_token", "eos_token"})


def takes_tools(tokenizer: Tokenizer | None) -> bool:
    """Whether the template renders ``tools`` itself (it reads the variable), as Qwen2.5/3, Llama 3.x,
    Mistral and SmolLM3 templates do."""
    template = tokenizer.chat_template if tokenizer is not None else None
    return template is not None and "tools" in template


def render(
    tokenizer: Tokenizer | None,
    limits: Any,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    max_tokens: int | None,
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any] | None,
) -> list[int]:
    """The prompt's token ids, checked as any prompt is (``prepare_prompt``); a 400 naming the field."""
    if tokenizer is None:
        param = "chat_template_kwargs" if kwargs else "tools"
        raise APIError(
            400, f"{param} needs the chat template on the gateway (the model's files are not on it)",
            code="invalid_value", param=param,
        )  # fmt: skip
    reserved = sorted(RESERVED & set(kwargs or {}))
    if reserved:
        message = f"chat_template_kwargs cannot set {', '.join(reserved)} (a field of its own does)"
        raise APIError(400, message, code="invalid_value", param="chat_template_kwargs")
    variables = dict(kwargs or {}) | ({"tools": tools} if tools else {})
    try:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except Exception as exc:  # template code is the checkpoint's: any failure is the input's fault
        message = f"the chat template rejected these messages: {exc}"
        raise APIError(400, message, code="invalid_value", param="messages") from None
    try:
        # The rendered template already holds bos and the other special tokens.
        return prepare_prompt(
            tokenizer.encode(text, add_special_tokens=False), limits, None, max_tokens=max_tokens
        )
    except PromptError as exc:
        raise APIError(400, str(exc), code="invalid_value", param=exc.param) from None
