"""Grammars compile off the step loop: a constrained request waits for its grammar while the others keep
stepping; a refused grammar fails only its request. Measured in steps and tokens, never in wall time: the
compile is held back by a gate the test opens."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import RequestStatus
from engine.structured.background import BackgroundCompiles
from engine.structured.grammar import GrammarCompiler
from engine.structured.spec import StructuredOutput

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def llm(tiny_llama_path: Path) -> LLM:
    return LLM(str(tiny_llama_path), max_model_len=256, num_blocks=128, block_size=8)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Compiles wait for this event: a compile as slow as the test wants."""
    opened = threading.Event()
    real = BackgroundCompiles.compile_hook

    def held(compiler: GrammarCompiler, spec: StructuredOutput) -> None:
        assert opened.wait(120)
        real(compiler, spec)

    monkeypatch.setattr(BackgroundCompiles, "compile_hook", staticmethod(held))
    return opened


def _tokens(outputs: list[RequestOutput], request_id: str) -> int:
    return sum(len(c.token_ids) for o in outputs if o.request_id == request_id for c in o.outputs)


def _run_out(engine: LLMEngine) -> list[RequestOutput]:
    outputs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.kv.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks  # no leaked block
    return outputs


def test_free_requests_keep_stepping_while_a_grammar_compiles(llm: LLM, gate: threading.Event) -> None:
    engine = llm.engine
    free = SamplingParams(max_tokens=40, ignore_eos=True, seed=1)
    engine.add_request("free", [5, 6, 7], free)
    first = engine.step()  # the free request is running
    pattern = r"[a-z]{3,8}-compile-[0-9]{2}"
    spec = StructuredOutput("regex", pattern, "guided_regex")
    engine.add_request("constrained", [5, 6, 7], SamplingParams(max_tokens=30, seed=2, structured=spec))
    (waiting,) = [r for r in engine.scheduler.requests.values() if r.request_id == "constrained"]
    outputs: list[RequestOutput] = []
    for _ in range(10):
        outputs += engine.step()
    # Ten steps, ten tokens for the free request; the constrained one waits, holding no block.
    assert _tokens(outputs, "free") == 10 and _tokens(outputs, "constrained") == 0
    assert waiting.waiting_for_grammar and waiting.status == RequestStatus.WAITING
    assert engine.kv.block_ids("constrained") == []
    gate.set()
    outputs += _run_out(engine)
    text = "".join(c.text for o in outputs if o.request_id == "constrained" for c in o.outputs)
    assert re.fullmatch(pattern, text), text
    assert _tokens(first + outputs, "free") == 40
    # The same grammar again is compiled already: its request does not wait at all.
    engine.add_request("again", [5, 6, 7], SamplingParams(max_tokens=30, seed=3, structured=spec))
    assert not engine.scheduler.requests["again"].waiting_for_grammar
    assert _tokens(engine.step(), "again") == 1
    _run_out(engine)


def test_a_refused_grammar_fails_only_its_request(llm: LLM, gate: threading.Event) -> None:
    engine = llm.engine
    engine.add_request("free", [8, 9], SamplingParams(max_tokens=20, ignore_eos=True, seed=1))
    bad = StructuredOutput("regex", "(?=a)b", "guided_regex")  # xgrammar refuses lookahead
    engine.add_request("bad", [8, 9], SamplingParams(max_tokens=8, n=2, structured=bad))
    outputs: list[RequestOutput] = []
    for _ in range(3):
        outputs += engine.step()
    assert _tokens(outputs, "free") == 3 and not any(o.request_id == "bad" for o in outputs)
    gate.set()
    outputs += _run_out(engine)
    (failed,) = [o for o in outputs if o.request_id == "bad"]
    assert (
        failed.finished
        and failed.error_param == "guided_regex"
        and "unsupported regex" in (failed.error or "")
    )
    assert [c.finish_reason for c in failed.outputs] == ["error", "error"]
    assert _tokens(outputs, "free") == 20


def test_an_abort_while_compiling_leaves_nothing_behind(llm: LLM, gate: threading.Event) -> None:
    engine = llm.engine
    spec = StructuredOutput("regex", "[0-9]{4}-aborted", "guided_regex")
    engine.add_request("gone", [3, 4], SamplingParams(max_tokens=8, structured=spec))
    engine.step()
    engine.abort_request("gone")
    gate.set()
    outputs = _run_out(engine)
    assert [c.finish_reason for o in outputs if o.request_id == "gone" for c in o.outputs] == ["abort"]
