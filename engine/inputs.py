"""The one context-length rule, for every edge that checks a prompt (torch-free: the gateway imports it).

The gateway checks it when it has the tokenizer, the worker when the gateway sent text, and the engine's
own API (``LLMEngine.add_request``) for callers that bypass both; all with this function, so the rule
and its message cannot drift apart.
"""

from __future__ import annotations


class ContextLengthError(ValueError):
    """The prompt (plus the tokens asked for) does not fit the model's context."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param  # the request field to blame: "prompt" or "max_tokens"

    def __reduce__(self) -> tuple[type[ContextLengthError], tuple[str, str]]:
        # An exception unpickles as cls(*self.args), and args holds the message only: rebuild from both.
        return type(self), (str(self), self.param)


def check_context_length(num_prompt_tokens: int, max_model_len: int, max_tokens: int | None = None) -> None:
    """Raise ``ContextLengthError`` unless the prompt leaves room for ``max_tokens`` (None: for one token).

    Example, max_model_len 8: a prompt of 7 fits with max_tokens None or 1; with max_tokens 2 it does not
    (blame max_tokens); a prompt of 8 never fits (blame the prompt).
    """
    wanted = num_prompt_tokens + (max_tokens or 1)
    if wanted <= max_model_len:
        return
    asked = f"{num_prompt_tokens} in the prompt" + (f" + {max_tokens} to generate" if max_tokens else "")
    raise ContextLengthError(
        f"This model's maximum context length (max_model_len) is {max_model_len} tokens; this request asks "
        f"for {asked}. Shorten the prompt or lower max_tokens.",
        "prompt" if num_prompt_tokens >= max_model_len else "max_tokens",
    )
