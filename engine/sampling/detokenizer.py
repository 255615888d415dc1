"""Token ids to streamed text, one step at a time, with stop strings.

Two things make this more than ``decode(new_ids)``:

* Decoding is not per-token: byte-level BPE splits a multi-byte character over several tokens (each
  decodes to '\ufffd' alone), and sentencepiece decoders drop a token's leading space when it starts
  the text. So each step decodes a short window of recent tokens twice, with and without the new ones,
  and emits the difference (the "prefix window" of HF's TextStreamer and vLLM):

      ids:   ... | prefix_offset ........ read_offset | new tokens |
      prefix_text = decode(ids[prefix_offset:read_offset])
      new_text    = decode(ids[prefix_offset:])       -> emit new_text[len(prefix_text):]

  While new_text ends in '\ufffd' (a character still incomplete) nothing is emitted and the offsets
  stay, so the next token completes it. Emitting advances the window: prefix_offset = read_offset.

* Stop strings: a stop string may arrive split over tokens. Text that could be the start of a stop
  string (a suffix equal to a stop string's proper prefix) is held back until it is ruled out, so a
  stop string never leaks to the client. When one completes, output ends right before it (or after
  it with include_stop_str_in_output). The stop that completes first, by character position, wins:
  the result does not depend on how the text was split into tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# Prompt tokens kept as left context, so the first output token decodes with its leading space.
_PROMPT_CONTEXT = 5


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class DetokenizerDelta:
    text: str  # new text since the previous call: never a broken character, never part of a stop
    stop_str: str | None = None  # the stop string that just ended the output, if one did


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas. With tokenizer=None every delta is empty."""

    def __init__(
        self,
        tokenizer: _Decoder | None,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = [s for s in (stop or []) if s] if tokenizer is not None else []
        self._include_stop = include_stop_str_in_output
        # Only the window is kept: ids before prefix_offset are dropped as the window advances.
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._held = ""  # decoded text held back because it may start a stop string
        self._chunks: list[str] = []  # everything emitted, joined lazily by output_text
        self._stop_str: str | None = None
        self._done = False  # a stop string matched, or flush() ran

    @property
    def output_text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the output, or None."""
        return self._stop_str

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> DetokenizerDelta:
        """Take the tokens sampled this step; return the text they release. ``stop_terminated``: the last
        of them is the stop token (eos or one of ``stop_token_ids``) that ended the output, whose text is
        not part of it unless the request asked for stop strings in its output (as vLLM and OpenAI do:
        with ``skip_special_tokens`` off, an ``<|im_end|>`` would otherwise end every answer)."""
        if stop_terminated and not self._include_stop:
            new_token_ids = new_token_ids[:-1]
        if self._tokenizer is None or self._done or not new_token_ids:
            return DetokenizerDelta("")
        self._ids.extend(new_token_ids)
        text = self._decode_window(final=False)
        if not text:
            return DetokenizerDelta("")
        return self._release(self._held + text, final=False)

    def replay(self, token_ids: list[int]) -> None:
        """Catch up with a stream another engine produced (a resume), discarding the text.

        One token at a time, as that stream was produced: fed at once, tokens ending mid-character
        would keep the whole replay in the window and release it again with the next token.
        """
        for token_id in token_ids:
            self.update([token_id])

    def flush(self) -> str:
        """At the end of a request (length, eos, abort): release everything still held back.

        An incomplete trailing character comes out as '\ufffd', as a full decode would show it. A
        stop string completed by the held text still truncates, and sets ``stop_str``.
        """
        if self._tokenizer is None or self._done:
            return ""
        delta = self._release(self._held + self._decode_window(final=True), final=True)
        self._done = True
        return delta.text

    # ---- internals -----------------------------------------------------------------------
    def _decode_window(self, final: bool) -> str:
        assert self._tokenizer is not None
        window = self._ids[self._prefix_offset :]
        prefix_text = self._tokenizer.decode(
            self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=self._skip_special_tokens
        )
        new_text = self._tokenizer.decode(window, skip_special_tokens=self._skip_special_tokens)
        # No growth: the new tokens were skipped specials, or merge with text still to come.
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not final):
            return ""
        # Advance: the tokens just decoded become the next step's left context.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return new_text[len(prefix_text) :]

    def _release(self, text: str, final: bool) -> DetokenizerDelta:
        """Emit ``text`` except what stop strings require: cut at a match, hold a possible start."""
        match = self._first_stop(text)
        if match is not None:
            start, stop = match
            out = text[: start + len(stop)] if self._include_stop else text[:start]
            self._held, self._stop_str, self._done = "", stop, True
            self._chunks.append(out)
            return DetokenizerDelta(out, stop)
        keep = 0 if final else self._possible_stop_prefix(text)
        out, self._held = text[: len(text) - keep], text[len(text) - keep :]
        self._chunks.append(out)
        return DetokenizerDelta(out)

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        # Held text plus new text covers every match not yet seen: a match starting earlier in the
        # emitted text would have been held back (it began with a stop string's prefix).
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _possible_stop_prefix(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string.

        Example: stops ["</answer>"], text "so the </an" -> 4 ("</an" may become "</answer>").
        """
        longest = 0
        for stop in self._stops:
            # Candidates start where stop[0] occurs in the last len(stop) - 1 characters, leftmost (the
            # longest) first: a scan of that tail, not a try of every length.
            first, end = stop[0], len(text)
            at = text.find(first, max(end - len(stop) + 1, 0), end - longest)
            while at >= 0:
                if stop.startswith(text[at:]):
                    longest = end - at
                    break
                at = text.find(first, at + 1, end - longest)
        return longest
