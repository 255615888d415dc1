"""OpenAI's ``logit_bias``: a fixed value added to chosen tokens' logits, per row, on the logits' device."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.sampling.sampler import SamplingRow


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """A copy of ``logits`` [N, V] with each row's biases added; ``logits`` itself when no row has any.

    Token ids at or past the vocabulary are skipped: the gateway refuses them where it knows the
    vocabulary size, and an id the model has no logit for has nothing to bias. Example: rows 0 and 2
    bias tokens {5: -100} and {7: 2.5, 9: 1}; the triples are (0, 5, -100), (2, 7, 2.5), (2, 9, 1),
    added in one ``index_put_`` after one host-to-device copy.
    """
    vocab = logits.shape[1]
    triples = [
        (float(i), float(token), bias)
        for i, r in enumerate(rows)
        if r.params.logit_bias
        for token, bias in r.params.logit_bias.items()
        if token < vocab
    ]
    if not triples:
        return logits
    # float64 carries the row and token indexes exactly (both far below 2**53).
    table = torch.tensor(triples, dtype=torch.float64).to(logits.device)  # [k, 3]
    index = (table[:, 0].long(), table[:, 1].long())
    return logits.index_put(index, table[:, 2].to(logits.dtype), accumulate=True)
