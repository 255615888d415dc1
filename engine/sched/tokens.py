"""What a sampled token does to its request: appended with its timestamps, then the stop check.

Shared by the synchronous scheduler and the async one (which sees each token one step late), so both
apply exactly the same rules in the same order.
"""

from __future__ import annotations

from engine.request import Request, RequestStatus


def add_token(request: Request, token: int, now: float) -> None:
    request.append_output_token(token)
    if request.timeline.first_token is None:
        request.timeline.first_token = now
        request.record("first_token", now)
    request.timeline.last_token = now


def check_stop(
    request: Request, token: int, eos_token_ids: set[int], max_model_len: int
) -> RequestStatus | None:
    """The terminal status ``token`` (just appended) puts the request in, or None to go on."""
    params = request.sampling_params
    if request.num_new_output_tokens + request.num_resumed_tokens >= params.min_tokens:
        if not params.ignore_eos and (token in eos_token_ids or token == request.eos_token_id):
            return RequestStatus.FINISHED_STOPPED
        if token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None


def reaches_limit(request: Request, max_model_len: int) -> bool:
    """True when the tokens in flight (placeholders) already bring the request to max_tokens or the
    model's length: its pending token is its last, whatever it turns out to be."""
    pending = request.num_output_placeholders
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is not None and request.num_output_tokens + pending >= max_tokens:
        return True
    return request.num_tokens + pending >= max_model_len
