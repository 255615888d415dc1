"""Which request fields are applied, which are accepted and change nothing, and the check that refuses
every other one by name.

A client that sends a field this server does not apply must learn so, not get an answer that silently
ignored it (a constraint dropped turns a "pick one of these" into free text). So every field of a body
is on one of two lists, and anything else is OpenAI's 400 with ``param`` naming it. Some applied fields
take only some values (``best_of`` equal to ``n``, an empty ``suffix``): other values are refused the
same way where the field is read (``prompts.py``). docs/api.md lists the same sets; a test holds the
three (these lists, the request models, the page) to each other.
"""

from __future__ import annotations

from services.gateway.errors import APIError
from services.gateway.protocol import _Sampling

# Applied by both endpoints: sampling, stopping, constraints, scheduling.
SAMPLING_APPLIED = frozenset(
    {
        "model",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stream_options",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "seed",
        "logit_bias",
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "priority",
        "slo_ttft_ms",
        "slo_tpot_ms",
        "session_id",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "prompt_logprobs",  # not with stream: they come with the whole response
    }
)
COMPLETION_APPLIED = SAMPLING_APPLIED | {
    "prompt",
    "max_tokens",
    "logprobs",
    "echo",
    "suffix",  # only empty: a fill-in-the-middle prompt needs a template this server does not have
    "best_of",  # only equal to n: there is no server-side ranking
}
CHAT_APPLIED = SAMPLING_APPLIED | {
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "add_generation_prompt",
    "chat_template_kwargs",
}
# Accepted, and the output is the same with or without them. ``user`` and ``prompt_cache_key`` do route a
# request (to the engine holding its session's prefix cache) but never change what it generates.
IGNORED = frozenset({"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"})


def check_fields(body: _Sampling) -> None:
    """OpenAI's 400 naming the first field of ``body`` that is on neither list (it would be dropped)."""
    name = next(iter(body.model_extra or {}), None)
    if name is not None:
        raise APIError(
            400,
            f"unknown field {name!r}: this server neither applies it nor knows it to change nothing, "
            "so it refuses it rather than drop it (docs/api.md lists the fields)",
            code="unsupported_field",
            param=name,
        )
