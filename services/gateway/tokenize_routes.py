"""``/tokenize`` and ``/detokenize`` as vLLM's server has them: the gateway's tokenizer and chat template,
the same ones that prepare a request's prompt, so a client can count or inspect what a request would run.

POST /tokenize    {"prompt": ...} or {"messages": [...]} -> {"count", "max_model_len", "tokens", "token_strs"}
POST /detokenize  {"tokens": [...]}                      -> {"prompt"}

Both need the model's tokenizer on the gateway (its checkpoint directory); without it they answer 501.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ConfigDict, Field

from engine.inputs import PromptError, PromptLimits, prepare_prompt
from engine.tokenizer import Tokenizer
from services.gateway import chat_template
from services.gateway.errors import APIError
from services.gateway.openai_routes import check_model
from services.gateway.prompts import ModelInfo, chat_messages, with_tools_message
from services.gateway.protocol import ChatMessage, TokenId, _Checked
from services.gateway.state import gateway

router = APIRouter()

_MAX_TOKENS = 1 << 20  # a detokenize body's ids: bounded like any body, before the tokenizer sees them


class TokenizeRequest(_Checked):
    """vLLM's two forms in one body: ``prompt`` (a completion's text) or ``messages`` (a chat, rendered
    with the template), one of them."""

    model_config = ConfigDict(extra="allow")  # refused by name in _checked, as the OpenAI routes do
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt; a rendered chat holds its own
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # For messages, as a chat request has them: tools the template renders itself, and its variables.
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=32)


class DetokenizeRequest(_Checked):
    model_config = ConfigDict(extra="allow")  # refused by name in _checked, as the OpenAI routes do
    model: str | None = None
    tokens: list[TokenId] = Field(max_length=_MAX_TOKENS)


def _checked(request: Request, body: TokenizeRequest | DetokenizeRequest) -> tuple[Tokenizer, ModelInfo]:
    """The gateway's tokenizer, after the body's fields (none unknown) and model are checked."""
    name = next(iter(body.model_extra or {}), None)
    if name is not None:
        raise APIError(400, f"unknown field {name!r}", code="unsupported_field", param=name)
    gw = gateway(request)
    if body.model is not None:
        check_model(gw, body.model)
    if gw.info.tokenizer is None:
        message = "this gateway has no tokenizer (the model's files are not on it)"
        raise APIError(501, message, code="no_tokenizer")
    return gw.info.tokenizer, gw.info


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    tokenizer, info = _checked(request, body)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give one of prompt and messages", code="invalid_value", param="prompt")
    return await asyncio.to_thread(_tokenize, body, tokenizer, info)


def _tokenize(body: TokenizeRequest, tokenizer: Tokenizer, info: ModelInfo) -> dict[str, Any]:
    # Counting, not admitting: a prompt longer than the context is counted too (no length limit).
    limits = PromptLimits(None, info.vocab_size)
    try:
        if body.messages is not None and (body.tools or body.chat_template_kwargs):
            # As a chat request with tools under "auto" renders them (prompts.prepare_chat).
            tools = body.tools if body.tools and chat_template.takes_tools(tokenizer) else None
            messages = chat_messages(body.messages)
            if body.tools and tools is None:
                messages = with_tools_message(messages, body.tools)
            ids = chat_template.render(
                tokenizer,
                limits,
                messages,
                add_generation_prompt=body.add_generation_prompt,
                max_tokens=None,
                tools=tools,
                kwargs=body.chat_template_kwargs,
            )
        elif body.messages is not None:
            messages = chat_messages(body.messages)
            ids = prepare_prompt(
                None, limits, tokenizer, messages=messages, add_generation_prompt=body.add_generation_prompt
            )
        elif body.add_special_tokens is False:
            ids = tokenizer.encode(body.prompt or "", add_special_tokens=False)
        else:
            ids = prepare_prompt(body.prompt, limits, tokenizer)
    except PromptError as exc:
        raise APIError(400, str(exc), code="invalid_value", param=exc.param) from None
    out: dict[str, Any] = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    tokenizer, info = _checked(request, body)
    if info.vocab_size is not None and any(t >= info.vocab_size for t in body.tokens):
        message = f"token ids must be below the vocabulary size {info.vocab_size}"
        raise APIError(400, message, code="invalid_value", param="tokens")
    text = await asyncio.to_thread(tokenizer.decode, list(body.tokens), skip_special_tokens=False)
    return {"prompt": text}
