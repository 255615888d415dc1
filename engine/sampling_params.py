"""Per-request sampling parameters, validated once at the edge of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.structured.spec import StructuredOutput

MAX_LOGIT_BIAS = 300  # OpenAI's bound on logit_bias entries
MAX_LOGPROBS = 20  # OpenAI's bound on top_logprobs; prompt_logprobs takes the same


@dataclass
class SamplingParams:
    """How one request's tokens are chosen and when it stops.

    Defaults follow the OpenAI / vLLM conventions so a caller moving from either feels at home.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off (vLLM's convention); 0 is accepted as off too
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-k logprobs per generated token; None: off
    # Top-k logprobs per prompt token (plus the token itself); None: off. Such a request skips the
    # prefix cache: a cached block's positions get no logits.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Constrained decoding: the output must match this (a JSON schema, regex, ...); None: free text.
    structured: StructuredOutput | None = None
    # Token id -> value added to its logit before anything else (OpenAI's logit_bias); None: none.
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logit_bias is not None:
            # Bounded: the sampler copies one (row, token, bias) triple per entry to the device each step.
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens")
            if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias.items()):
                raise ValueError("logit_bias maps token ids (>= 0) to biases in [-100, 100]")
            self.logit_bias = self.logit_bias or None

    @property
    def greedy(self) -> bool:
        # temperature 0 means argmax; the other sampling knobs then have nothing to act on.
        return self.temperature < 1e-5

    @property
    def effective_top_k(self) -> int:
        """top_k with 0 and -1 both meaning 'off' (returned as 0)."""
        return self.top_k if self.top_k > 0 else 0
