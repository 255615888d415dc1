"""Build a scheduler without a model: the scheduler and KV manager are pure bookkeeping."""

from __future__ import annotations

import weakref

import torch

from engine.config import EngineConfig, ModelConfig
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler

EOS = 2


def model_config(max_pos: int = 4096) -> ModelConfig:
    return ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 128,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "max_position_embeddings": max_pos,
            "eos_token_id": EOS,
        }
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 256,
    policy: str = "fcfs",
    batching: str = "continuous",
    prefix_caching: bool = True,
    chunked_prefill: bool = True,
) -> Scheduler:
    cfg = EngineConfig(
        model_path="<none>",
        model=model_config(),
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=block_size,
        enable_prefix_caching=prefix_caching,
        enable_chunked_prefill=chunked_prefill,
        scheduling_policy=policy,
        batching=batching,
        attention_backend="torch",
        seed=0,
        load_format="auto",
        max_waiting=None,
        enable_cuda_graph=False,
    )
    kv = KVCacheManager(num_blocks, block_size, prefix_caching)
    return Scheduler(cfg, kv, {EOS})


def make_request(
    request_id: str,
    prompt_len: int,
    max_tokens: int = 16,
    priority: int = 0,
    first_token: int = 10,
    **kw: object,
) -> Request:
    prompt = [(first_token + i) % 100 + 10 for i in range(prompt_len)]
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **kw),  # type: ignore[arg-type]
        EOS,
        priority=priority,
    )


def step(sched: Scheduler, token_for: dict[str, int] | None = None, default: int = 50) -> SchedulerOutput:
    """One step with a fake model: every request that completes its tokens samples `default`
    (or the token given for it)."""
    out = sched.schedule()
    check_runner_view(sched, out)
    sampled = {}
    for r in scheduled(sched, out):
        if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens:
            sampled[r.request_id] = (token_for or {}).get(r.request_id, default)
    sched.update_from_output(out, sampled)
    sched.kv.check_integrity()
    return out


def scheduled(sched: Scheduler, out: SchedulerOutput) -> list[Request]:
    """The live requests of a step, in batch order (the output itself carries only ids and data)."""
    return [sched.requests[i] for i in out.num_scheduled_tokens]


# Block tables rebuilt from the outputs alone, per scheduler: what a runner would hold.
_runner_views: weakref.WeakKeyDictionary[Scheduler, dict[str, list[int]]] = weakref.WeakKeyDictionary()


def check_runner_view(sched: Scheduler, out: SchedulerOutput) -> None:
    """Applying the output's diffs to the previous steps' gives exactly the manager's block tables."""
    view = _runner_views.setdefault(sched, {})
    for req_id in [*out.finished_req_ids, *out.preempted_req_ids]:
        view.pop(req_id, None)
    for new in out.scheduled_new_reqs:
        assert new.req_id not in view, f"{new.req_id} sent as new while the runner holds it"
        view[new.req_id] = list(new.block_ids)
    for cached in out.scheduled_cached_reqs:
        view[cached.req_id] += cached.new_block_ids
    sent = [r.req_id for r in out.scheduled_new_reqs] + [r.req_id for r in out.scheduled_cached_reqs]
    assert sorted(sent) == sorted(out.num_scheduled_tokens)  # each scheduled request described once
    for req_id, num_scheduled in out.num_scheduled_tokens.items():
        # Entries freed for leaving a sliding window are not sent: the runner keeps their old ids.
        freed = sched.kv.num_freed_blocks(req_id)
        assert len(view[req_id]) == len(sched.kv.block_ids(req_id))
        assert view[req_id][freed:] == sched.kv.block_ids(req_id)[freed:]
        needed = sched.requests[req_id].num_computed_tokens + num_scheduled
        assert len(view[req_id]) * sched.kv.block_size >= needed
