"""IncrementalDetokenizer: deltas add up to a full decode, never split a character or leak a stop string."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.sampling.detokenizer import DetokenizerDelta, IncrementalDetokenizer
from engine.tokenizer import Tokenizer, load_tokenizer

# Rare CJK characters and emoji are not merged by the tiny tokenizer: each spans several byte tokens.
MULTIBYTE = "Hello 龍 and 鬱 plus 🦀🚀 café — 你好，世界！ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 done."
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def tok(tiny_llama_path: Path) -> Tokenizer:
    loaded = load_tokenizer(tiny_llama_path)
    assert loaded is not None
    return loaded


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> Iterator[DetokenizerDelta]:
    """Feed ``ids`` in chunks, lazily: each delta is produced when the consumer asks for it."""
    for i in range(0, len(ids), chunk):
        yield detok.update(ids[i : i + chunk])


def test_multibyte_deltas_add_up_and_never_break_a_character(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    # The text really does split characters across tokens, so the hold-back path runs.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode(PROMPT))
    deltas = list(stream(detok, ids))
    assert all("\ufffd" not in d.text for d in deltas)
    assert all(d.stop_str is None for d in deltas)
    assert "".join(d.text for d in deltas) + detok.flush() == tok.decode(ids) == MULTIBYTE
    assert detok.output_text == MULTIBYTE
    # Some steps released nothing (half a character) and some released several tokens' worth.
    assert any(d.text == "" for d in deltas)


@pytest.mark.parametrize("chunk", [2, 3, 7, 1000])
def test_chunked_updates_give_the_same_text(tok: Tokenizer, chunk: int) -> None:
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(d.text for d in stream(detok, ids, chunk)) + detok.flush()
    assert text == MULTIBYTE


def test_window_stays_short(tok: Tokenizer) -> None:
    # Decoding must not grow with the output: every decode call sees only a few recent tokens.
    seen: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            seen.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = tok.encode(MULTIBYTE * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(Counting(), tok.encode(PROMPT * 20))
    text = "".join(d.text for d in stream(detok, ids)) + detok.flush()
    assert text == MULTIBYTE * 20
    assert len(ids) > 300 and max(seen) <= 12


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tok: Tokenizer, skip: bool) -> None:
    ids = tok.encode("Hi there<|im_end|>\n<|im_start|>user", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    text = "".join(d.text for d in stream(detok, ids)) + detok.flush()
    assert text == tok.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in text) == (not skip)


def test_random_token_soup_matches_full_decode(tok: Tokenizer) -> None:
    # Arbitrary ids produce invalid UTF-8 and stray specials; deltas must still add up exactly.
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        detok = IncrementalDetokenizer(tok, prompt)
        text = "".join(d.text for d in stream(detok, ids, rng.randint(1, 4))) + detok.flush()
        assert text == tok.decode(ids)


def test_flush_releases_an_incomplete_character(tok: Tokenizer) -> None:
    ids = tok.encode("ab 龍", add_special_tokens=False)
    cut = ids[:-1]  # the last byte of 龍 never arrives
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(d.text for d in stream(detok, cut))
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(cut)
    assert tok.decode(cut).endswith("\ufffd")
    assert detok.flush() == "" and detok.update(ids[-1:]).text == ""  # finished: nothing more


TEXT = "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village near the sea."


def _split_stop(tok: Tokenizer, ids: list[int], stop: str) -> bool:
    """True when no single token's text contains ``stop``: it can only appear across tokens."""
    return all(stop not in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("stop", ["own fox ju", "lazy dog. Once", "e sea."])
@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_split_across_tokens_never_leaks(
    tok: Tokenizer, stop: str, include: bool, chunk: int
) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert _split_stop(tok, ids, stop)
    at = TEXT.index(stop)
    expected = TEXT[: at + len(stop)] if include else TEXT[:at]
    detok = IncrementalDetokenizer(tok, [], stop=["never appears", stop], include_stop_str_in_output=include)
    emitted = ""
    stopped = None
    for d in stream(detok, ids, chunk):
        emitted += d.text
        # At every step the emitted text is a prefix of the answer: no piece of the stop got out early.
        assert expected.startswith(emitted)
        if d.stop_str is not None:
            stopped = d.stop_str
            break
    assert stopped == stop == detok.stop_str
    assert emitted == detok.output_text == expected
    assert detok.update(ids[:1]) == DetokenizerDelta("")
    assert detok.flush() == ""


def test_stop_string_candidate_is_held_then_released(tok: Tokenizer) -> None:
    # "fox jumps!" never completes, but its start "fox jumps" is held back until ruled out.
    ids = tok.encode(TEXT, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [], stop=["fox jumps!"])
    outputs = []
    for token in ids:
        assert detok.update([token]).stop_str is None
        outputs.append(detok.output_text)
    assert any(o.endswith("brown ") for o in outputs)  # held while "fox ..." could still be the stop
    assert not any(o.endswith("fox") or o.endswith("fox jumps") for o in outputs)
    assert detok.output_text + detok.flush() == TEXT


def test_first_completed_stop_wins_whatever_the_chunking(tok: Tokenizer) -> None:
    # "brown fox jumps" starts first but "fox" completes first; the result must not depend on chunks.
    ids = tok.encode(TEXT, add_special_tokens=False)
    results = set()
    for chunk in (1, 2, 5, len(ids)):
        detok = IncrementalDetokenizer(tok, [], stop=["brown fox jumps", "fox"])
        deltas = stream(detok, ids, chunk)
        results.add(("".join(d.text for d in deltas), detok.stop_str))
    assert results == {(TEXT[: TEXT.index("fox")], "fox")}


def test_stop_completed_by_flush(tok: Tokenizer) -> None:
    # A stop string followed by half a character is only seen at the end: flush still cuts it.
    ids = tok.encode("tail END龍", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tok, [], stop=["END"])
    streamed = "".join(d.text for d in stream(detok, ids))
    tail = detok.flush()
    assert streamed + tail == "tail " and detok.stop_str == "END"


def test_no_tokenizer_means_no_text() -> None:
    detok = IncrementalDetokenizer(None, [1, 2, 3], stop=["x"])
    assert detok.update([4, 5]) == DetokenizerDelta("", None)
    assert detok.flush() == "" and detok.output_text == "" and detok.stop_str is None


def test_replay_continues_where_an_uninterrupted_stream_was(tok: Tokenizer) -> None:
    """A resumed stream: the new engine replays what the dead one streamed, then continues.

    Whatever the cut (mid-character included: the dead engine held those bytes back), the text the
    first stream released plus the continuation's is the whole text, with nothing repeated.
    """
    prompt = tok.encode(PROMPT)
    ids = tok.encode(MULTIBYTE, add_special_tokens=False)
    for cut in range(1, len(ids)):
        first = IncrementalDetokenizer(tok, prompt)
        released = "".join(d.text for d in stream(first, ids[:cut]))  # then the worker died: no flush
        second = IncrementalDetokenizer(tok, prompt)
        second.replay(ids[:cut])
        rest = "".join(d.text for d in stream(second, ids[cut:])) + second.flush()
        assert released + rest == MULTIBYTE, f"cut at {cut}"


def test_held_back_prefix_is_the_longest_a_stop_could_still_complete() -> None:
    # Against the definition, on a small alphabet (many overlapping partial matches): the longest suffix
    # of the text that is a proper prefix of some stop string.
    rnd = random.Random(7)
    for _ in range(2000):
        stops = ["".join(rnd.choices("ab", k=rnd.randint(1, 6))) for _ in range(rnd.randint(1, 3))]
        text = "".join(rnd.choices("abc", k=rnd.randint(0, 10)))
        want = max(
            (k for s in stops for k in range(min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
            default=0,
        )
        detok = IncrementalDetokenizer(_Echo(), [], stop=stops)
        assert detok._possible_stop_prefix(text) == want, (stops, text)


class _Echo:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""
