"""Structured outputs in the engine: constrained rows match, free rows are untouched, bad specs refused."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.core.messages import (
    AddRequest,
    SeqOutput,
    Step,
    client_codec,
    core_codec,
)
from engine.inputs import EngineRequest
from engine.sampling.sampler import Sampler, SamplingRow
from engine.structured.spec import StructuredOutput, StructuredOutputError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"age": {"type": "integer"}, "vip": {"type": "boolean"}},
            "required": ["age", "vip"],
        },
    },
    "required": ["name", "kind", "owner"],
}
PROMPTS = ["hello there", "the cat sat", "one two three", "json please"]


@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> LLM:
    return LLM(str(tiny_llama_path), max_model_len=512, num_blocks=256, block_size=8)


def _clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks


def test_json_schema_outputs_validate_at_temperature_1(llm: LLM) -> None:
    spec = StructuredOutput.json_schema(SCHEMA)
    params = SamplingParams(temperature=1.0, max_tokens=300, n=4, seed=7, structured=spec)
    finished = 0
    for out in llm.generate(PROMPTS, params):
        for c in out.outputs:
            if c.finish_reason == "stop":  # by grammar termination: eos is allowed only once it is complete
                jsonschema.validate(json.loads(c.text), SCHEMA)
                finished += 1
    assert finished >= 12  # the random model still ends almost every object within 300 tokens
    _clean(llm)


def test_json_object_regex_and_choice(llm: LLM) -> None:
    outs = llm.generate(
        PROMPTS,
        SamplingParams(temperature=1.0, max_tokens=300, seed=3, structured=StructuredOutput("json_object")),
    )
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(out.outputs[0].text), dict)
    regex = StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}")
    for out in llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=50, structured=regex)):
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", out.outputs[0].text), out.outputs[0].text
    choice = StructuredOutput("choice", json.dumps(["yes", "no", "maybe later"]))
    for out in llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=50, structured=choice)):
        assert out.outputs[0].text in ("yes", "no", "maybe later")
    _clean(llm)


def test_free_rows_get_the_same_tokens_beside_constrained_ones(llm: LLM) -> None:
    free = SamplingParams(temperature=1.0, max_tokens=24, seed=11, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    engine = llm.engine
    constrained = SamplingParams(
        temperature=1.0, max_tokens=40, seed=5, structured=StructuredOutput.json_schema(SCHEMA)
    )
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"free-{i}", prompt, free)
        engine.add_request(f"json-{i}", prompt, constrained)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():  # deltas: each step's new tokens
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert [tokens[f"free-{i}"] for i in range(len(PROMPTS))] == alone
    _clean(llm)


def test_resumed_request_replays_its_grammar_state(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0, max_tokens=200, seed=21, structured=StructuredOutput.json_schema(SCHEMA)
    )
    whole = llm.generate(["resume me"], params)[0].outputs[0]
    assert len(whole.token_ids) > 6
    engine = llm.engine
    head = whole.token_ids[:5]
    engine.add_request(EngineRequest("resumed", "resume me", params, resume_token_ids=head))
    tail: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tail += out.outputs[0].token_ids if out.request_id == "resumed" else []
    assert head + tail == whole.token_ids  # the fresh matcher took the first 5 tokens, then went on alike
    _clean(llm)


@pytest.mark.parametrize(
    "spec",
    [
        StructuredOutput("json_schema", json.dumps({"type": "bogus"})),
        StructuredOutput("regex", "(((", param="guided_regex"),
        StructuredOutput("grammar", "root ::= nothing_defined", param="guided_grammar"),
    ],
)
def test_bad_specs_are_refused_with_their_param(llm: LLM, spec: StructuredOutput) -> None:
    # Compiled off the step loop, a refused grammar fails its request (not the call), naming the field.
    (out,) = llm.generate(["x"], SamplingParams(max_tokens=4, structured=spec))
    assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
    assert out.error is not None and out.error_param == spec.param
    # Across the core's pipe the failure keeps its param (the worker answers 400 naming the field).
    failed = SeqOutput("x", 0, [], "error", None, None, 0, None, out.error, out.error_param)
    step = client_codec().decode(core_codec().encode(Step([failed])))
    wired = step.outputs[0]
    assert wired.error == out.error and wired.error_param == spec.param
    _clean(llm)
    assert llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))[0].outputs[0].token_ids


def test_spec_shapes_are_checked_and_travel_the_core_pipe() -> None:
    with pytest.raises(StructuredOutputError, match="object"):
        StructuredOutput("json_schema", "[1]")
    with pytest.raises(StructuredOutputError, match="strings"):
        StructuredOutput("choice", "[]")
    spec = StructuredOutput.json_schema(SCHEMA)
    codec = core_codec()
    request = EngineRequest("r", [1, 2], SamplingParams(structured=spec))
    decoded = codec.decode(codec.encode(AddRequest(1, request)))
    assert decoded.request.params.structured == spec
    assert StructuredOutput.json_schema(SCHEMA).key == spec.key  # the cache key: same spec, same hash
    assert StructuredOutput("regex", "a").key != StructuredOutput("grammar", "a").key


def test_async_scheduling_and_preemption_keep_the_same_outputs(llm: LLM, tiny_llama_path: Path) -> None:
    """Seeded draws depend on (seed, position) only, so a constrained request must give the same tokens
    whether its step overlapped the previous one and whether it was preempted (its matcher rebuilt from
    its tokens) on the way."""
    params = SamplingParams(
        temperature=1.0, max_tokens=120, n=3, seed=4, structured=StructuredOutput.json_schema(SCHEMA)
    )
    want = [[c.token_ids for c in o.outputs] for o in llm.generate(PROMPTS, params)]
    tight = LLM(str(tiny_llama_path), max_model_len=512, num_blocks=64, block_size=8, async_scheduling=True)
    got = [[c.token_ids for c in o.outputs] for o in tight.generate(PROMPTS, params)]
    assert got == want
    assert tight.engine.scheduler.num_preemptions > 0
    _clean(tight)


def test_grammar_wins_over_min_tokens(llm: LLM) -> None:
    # Once "yes" is written the grammar allows eos alone: min_tokens must not ban it (every logit -inf),
    # and until min_tokens is reached the complete grammar keeps allowing eos alone (no free tail).
    params = SamplingParams(max_tokens=20, min_tokens=10, structured=StructuredOutput("choice", '["yes"]'))
    out = llm.generate(["say yes"], params)[0].outputs[0]
    assert (out.text, out.finish_reason) == ("yes", "stop")
    assert len(out.token_ids) >= 10
    _clean(llm)


def test_unconstrained_batches_do_no_mask_work(llm: LLM) -> None:
    sampler = llm.engine.runner.sampler
    before = sampler.grammar_seconds
    llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=8))
    assert sampler.grammar_seconds == before  # no bitmask filled, applied or advanced
    fresh = Sampler()
    row = SamplingRow(SamplingParams(), [1, 2], [], seed=0)
    assert fresh.begin_masks([row], 1024) is None and fresh._mask_pool is None  # no helper thread either
