"""The model runner on its own, fed hand-built SchedulerOutputs: no scheduler, no KV cache manager.

What the runner computes must depend only on the plain data it is given: the same tokens as the whole
engine, whichever block ids the caller picked and however a prefill is chunked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineArgs, EngineConfig
from engine.llm import LLM
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = {"a": [11, 12, 13, 14, 15, 16], "b": [21, 22, 23]}


@pytest.fixture(scope="module")
def runner(tiny_llama_path: Path) -> ModelRunner:
    args = EngineArgs.from_kwargs(str(tiny_llama_path), num_blocks=32, block_size=BLOCK, max_num_seqs=4)
    return ModelRunner(EngineConfig.resolve(args))


@pytest.fixture(scope="module")
def engine_tokens(tiny_llama_path: Path) -> dict[str, list[int]]:
    outs = LLM(str(tiny_llama_path), block_size=BLOCK).generate(list(PROMPTS.values()), GREEDY)
    return {name: o.outputs[0].token_ids for name, o in zip(PROMPTS, outs, strict=True)}


def _new(req_id: str, blocks: list[int], prompt: list[int] | None = None) -> NewRequestData:
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=prompt or PROMPTS[req_id],
        output_token_ids=[],
        sampling_params=GREEDY,
        seed=0,
        eos_token_id=None,
        block_ids=blocks,
        num_computed_tokens=0,
    )


def _drive(
    runner: ModelRunner, blocks: dict[str, list[int]], chunk: int, spare: list[int]
) -> dict[str, list[int]]:
    """Run the prompts to 8 tokens each, building every SchedulerOutput by hand as a scheduler would:
    ``chunk`` prompt tokens a step at most, blocks handed out from ``spare`` as positions need them."""
    computed = dict.fromkeys(PROMPTS, 0)
    num_tokens = {name: len(p) for name, p in PROMPTS.items()}
    sampled: dict[str, list[int]] = {name: [] for name in PROMPTS}
    held = {name: list(b) for name, b in blocks.items()}
    sent: set[str] = set()
    finished: set[str] = set()
    while any(len(t) < 8 for t in sampled.values()):
        out = SchedulerOutput(finished_req_ids=finished)
        finished = set()
        for name in PROMPTS:
            if len(sampled[name]) >= 8:
                continue
            n = min(num_tokens[name] - computed[name], chunk)
            new_blocks = []
            while len(held[name]) * BLOCK < computed[name] + n:
                new_blocks.append(spare.pop())
                held[name].append(new_blocks[-1])
            if name in sent:
                out.scheduled_cached_reqs.append(CachedRequestData(name, new_blocks, computed[name]))
            else:
                out.scheduled_new_reqs.append(_new(name, held[name]))
                sent.add(name)
            out.num_scheduled_tokens[name] = n
            out.total_num_scheduled_tokens += n
        # A request samples when the step computes its last known token (a prefill chunk short of it doesn't).
        expected = {
            name for name, n in out.num_scheduled_tokens.items() if computed[name] + n == num_tokens[name]
        }
        result = runner.execute(out)
        assert set(result.sampled) == expected
        for name, n in out.num_scheduled_tokens.items():
            computed[name] += n
            if name in result.sampled:
                sampled[name].append(result.sampled[name])
                num_tokens[name] += 1
                if len(sampled[name]) == 8:
                    finished.add(name)
    runner.update_rows(SchedulerOutput(finished_req_ids=finished))
    assert not runner.input_batch.requests  # every row given back
    return sampled


def test_runner_alone_matches_the_engine(runner: ModelRunner, engine_tokens: dict[str, list[int]]) -> None:
    got = _drive(runner, {"a": [5, 2], "b": [7]}, chunk=64, spare=[30, 1, 9, 20])
    assert got == engine_tokens


def test_block_ids_and_prefill_chunks_do_not_change_the_tokens(
    runner: ModelRunner, engine_tokens: dict[str, list[int]]
) -> None:
    # Other (scrambled) blocks, prefill in chunks of 2 tokens, blocks handed out as positions need them.
    got = _drive(runner, {"a": [17], "b": [3]}, chunk=2, spare=[0, 28, 12, 4, 25, 8])
    assert got == engine_tokens


def test_a_preempted_request_comes_back_with_its_outputs(
    runner: ModelRunner, engine_tokens: dict[str, list[int]]
) -> None:
    """Re-admitted after a preemption, a request is new again: prompt and earlier outputs, recomputed."""
    first = runner.execute(
        SchedulerOutput(
            scheduled_new_reqs=[_new("a", [4, 6])],
            num_scheduled_tokens={"a": 6},
            total_num_scheduled_tokens=6,
        )
    )
    earlier = [first.sampled["a"]]
    again = NewRequestData(
        req_id="a",
        prompt_token_ids=PROMPTS["a"],
        output_token_ids=earlier,
        sampling_params=GREEDY,
        seed=0,
        eos_token_id=None,
        block_ids=[10, 11],
        num_computed_tokens=0,
    )
    out = SchedulerOutput(
        scheduled_new_reqs=[again],
        num_scheduled_tokens={"a": 7},
        total_num_scheduled_tokens=7,
        preempted_req_ids=["a"],
    )
    second = runner.execute(out)
    assert [*earlier, second.sampled["a"]] == engine_tokens["a"][:2]
    runner.update_rows(SchedulerOutput(finished_req_ids={"a"}))
