"""The engine core's pipe messages: what one side encodes, the other decodes to the same values.

``python tests/engine/test_core_messages.py`` prints the cost of a 64-request step message, encoded and
decoded, against pickling the same engine objects (what the pipe carried before).
"""

from __future__ import annotations

import pickle
import random
import time
from collections.abc import Callable

import msgspec
import pytest

from engine.core.messages import (
    AbortRequest,
    AddRequest,
    Failure,
    Inspect,
    Reply,
    SeqOutput,
    Shutdown,
    Step,
    StopSequence,
    client_codec,
    core_codec,
    seq_of,
)
from engine.inputs import ContextLengthError, EngineRequest
from engine.metrics import RequestRecord, SchedulerStats, StepRecord
from engine.prompt_logprobs import PromptLogprobs
from engine.sampling_params import SamplingParams


def step_outputs(num_requests: int = 64, prompt_len: int = 256) -> tuple[list[SeqOutput], StepRecord]:
    """A decode step of ``num_requests`` requests, two of them finishing (with their records)."""
    rnd = random.Random(0)
    stats = SchedulerStats(num_requests, 3, num_requests, num_requests, 0.4, 100, 5000, 1200, 2, 0, 0, 512)
    outputs = []
    for i in range(num_requests):
        done = i < 2
        record = None
        if done:
            events: list[tuple[str, float, dict[str, int | str]]] = [("scheduled", 1.1, {"num_tokens": 64})]
            record = RequestRecord(
                f"r{i}", "length", prompt_len, 100, 64, 1.0, 1.1, 1.2, 1.2, 2.0, 0, 0.1, 0.2, 0.01, 0, events
            )
        logprobs = [{rnd.randrange(32000): -0.5, 7: -1.25}] if i % 8 == 0 else None
        # The core's output is token ids: the prompt went with the request, text is the client's.
        token = [rnd.randrange(32000)]
        outputs.append(SeqOutput(f"r{i}", 0, token, "length" if done else None, None, logprobs, 57, record))
    batch = [(f"r{i}", 1, 300) for i in range(num_requests)]
    return outputs, StepRecord(1234, 100.0, 0.001, 0.02, stats, batch, 0.002)


def test_a_step_crosses_with_every_field() -> None:
    outputs, record = step_outputs()
    finished = [o.metrics for o in outputs if o.metrics is not None]
    raw = core_codec().encode(Step(outputs, [record], finished, record.stats, True))
    step = client_codec().decode(raw)
    assert isinstance(step, Step) and step.busy and step.load == record.stats
    assert step.steps == [record] and step.finished == finished
    assert step.outputs == outputs  # int logprob keys, the stop reason's union, the records: all as sent
    # A first token with its prompt's logprobs (prompt tokens 1 and 2: the token, then the top 1).
    first = SeqOutput(
        "p", 0, [5], prompt_logprobs=PromptLogprobs(1, [[9, 4], [4, 4]], [[-2.5, -0.5], [-0.1, -0.1]], [3, 1])
    )
    again = client_codec().decode(core_codec().encode(Step([first])))
    assert again.outputs == [first]
    assert again.outputs[0].prompt_logprobs.entries() == [None, {9: (-2.5, 3), 4: (-0.5, 1)}, {4: (-0.1, 1)}]


def test_commands_cross_and_sampling_params_are_validated_on_arrival() -> None:
    params = SamplingParams(n=2, temperature=0.5, stop=["x"], seed=3, logprobs=2)
    commands = [
        AddRequest(1, EngineRequest("a", [1, 2], params, 3, 12.5, None, {0: [5], 1: []}, [0, 1], 0.5, None)),
        AddRequest(2, EngineRequest("b", "text")),
        AbortRequest("a"),
        StopSequence("a", 1, "x"),
        Inspect(3, "kv_integrity"),
        Shutdown(),
    ]
    encoder, decoder = client_codec(), core_codec()
    assert [decoder.decode(encoder.encode(c)) for c in commands] == commands
    bad = AddRequest(4, EngineRequest("c", [1], SamplingParams()))
    fields = msgspec.msgpack.decode(encoder.encode(bad))
    fields[2][2]["n"] = 0  # the request's params: what their __post_init__ refuses
    raw = msgspec.msgpack.encode(fields)
    with pytest.raises(msgspec.ValidationError, match="n must be at least 1"):
        decoder.decode(raw)
    assert seq_of(raw) == 4  # so the core can refuse that one command


@pytest.mark.parametrize(
    ("exc", "kind", "param"),
    [
        (ContextLengthError("too long", "max_tokens"), "context_length", "max_tokens"),
        (ValueError("bad token"), "invalid", None),
        (KeyError("x"), "internal", None),
    ],
)
def test_errors_cross_as_data_and_come_back_typed(exc: Exception, kind: str, param: str | None) -> None:
    failure = Failure.of(exc)
    back = client_codec().decode(core_codec().encode(Reply(9, error=failure)))
    assert back.error == failure and failure.kind == kind and failure.param == param
    raised = back.error.exception()
    assert type(raised) is {"context_length": ContextLengthError, "invalid": ValueError}.get(
        kind, RuntimeError
    )
    if isinstance(raised, ContextLengthError):
        assert raised.param == param and str(raised) == "too long"


def test_context_length_error_survives_pickling() -> None:
    # The exception still crosses process boundaries elsewhere (spawned tests, executors).
    back = pickle.loads(pickle.dumps(ContextLengthError("too long", "prompt")))
    assert isinstance(back, ContextLengthError) and back.param == "prompt" and str(back) == "too long"


def _best_us(fn: Callable[[], object], repeats: int = 7, number: int = 200) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - began) / number)
    return best * 1e6


def measure_one(num_requests: int, prompt_len: int) -> str:
    """Encode + decode of one step message: pickled engine objects (before) vs msgspec (now)."""
    from multiprocessing.reduction import ForkingPickler  # what Connection.send pickled with

    outputs, record = step_outputs(num_requests, prompt_len)
    finished = [o.metrics for o in outputs if o.metrics is not None]
    old = (outputs, [record], finished, record.stats)
    blob = bytes(ForkingPickler.dumps(old))
    pickled = _best_us(lambda: ForkingPickler.dumps(old)) + _best_us(lambda: pickle.loads(blob))
    encoder, decoder = core_codec(), client_codec()

    def encode() -> bytes:
        return encoder.encode(Step(outputs, [record], finished, record.stats))

    raw = encode()

    def decode() -> list[SeqOutput]:
        return list(decoder.decode(raw).outputs)

    now = _best_us(encode) + _best_us(decode)
    return (
        f"{num_requests} requests, prompts of {prompt_len} tokens: pickle {pickled:.0f} us "
        f"({len(blob)} bytes), msgspec {now:.0f} us ({len(raw)} bytes)"
    )


if __name__ == "__main__":
    for length in (16, 256, 1024):
        print(measure_one(64, length))
