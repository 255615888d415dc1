"""Compiled grammars (xgrammar) and the per-sequence matchers that constrain sampling.

One ``GrammarCompiler`` per model (its vocabulary, its stop tokens) keeps a bounded LRU cache of compiled
grammars keyed by the spec's hash: a schema that many requests share compiles once. A ``GrammarState`` is
one sequence's position in its grammar: the sampler asks it for the step's allowed tokens (a bitmask row)
and hands it the token it chose. A resumed or preempted sequence gets a fresh state that replays its
output tokens, so its constraint continues exactly where it left off.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import numpy as np
import torch
import xgrammar as xgr

from engine.config import EngineConfig
from engine.structured.compile_proc import CompileProcess, CompileTimeout, compile_spec
from engine.structured.spec import StructuredOutput, StructuredOutputError
from engine.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)

# Compiled grammars kept per model. A JSON schema's compiled form is tens to hundreds of KiB (its token
# masks are precomputed per grammar state), so 256 bounds the cache to tens of MiB while keeping every
# schema of a typical deployment (a handful of tool sets and response formats) hot.
MAX_CACHED_GRAMMARS = 256


def _bit(i: int) -> int:
    """Bit i of an int32 word, as the signed value torch's int32 takes (bit 31 is the sign)."""
    return (1 << i) - (1 << 32) if i == 31 else 1 << i


class GrammarState:
    """One sequence's matcher: which tokens may come next, advanced by each accepted token."""

    def __init__(self, compiled: xgr.CompiledGrammar, keep: torch.Tensor | None = None) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._keep = keep  # [ceil(V / 32)] int32: tokens never allowed have their bit cleared
        self.failed = False  # a token the grammar refused (never after a masked draw): stop constraining

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this sequence's allowed tokens into ``bitmask[row]`` (int32 words, one bit per token)."""
        if self.failed:
            bitmask[row].fill_(-1)  # nothing left to constrain: every token allowed
        elif self._matcher.is_terminated():
            # Complete, and eos taken, yet the row goes on (min_tokens, ignore_eos): only eos again.
            bitmask[row].zero_()
            for token in self._matcher.stop_token_ids:
                bitmask[row, token // 32] |= _bit(token % 32)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)
            if self._keep is not None:
                bitmask[row].bitwise_and_(self._keep)

    def accept(self, token_id: int) -> None:
        if self.failed or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token_id):
            self.failed = True
            logger.warning("grammar refused token %d: the sequence continues unconstrained", token_id)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()


class GrammarCompiler:
    """``compile_timeout_s``: compiles run in a child process killed past this bound (compile_proc.py);
    None: in this process, unbounded."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        compile_timeout_s: float | None = None,
    ) -> None:
        # The logits' width (the model's vocab_size) may exceed the tokenizer's: padded ids get "" and are
        # never allowed by a grammar.
        vocab = [""] * vocab_size
        for token, idx in tokenizer.backend.get_vocab(with_added_tokens=True).items():
            if idx < vocab_size:
                vocab[idx] = token
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
        info = xgr.TokenizerInfo(
            vocab,
            meta["vocab_type"],
            vocab_size=vocab_size,
            stop_token_ids=stop_token_ids,
            add_prefix_space=meta["add_prefix_space"],
        )
        self.vocab_size = vocab_size
        # A JSON schema's output never holds a raw control byte (strings escape them, and the schema's
        # separators are fixed spaces), but xgrammar's rule for a string with minLength / maxLength lets
        # them through; tokens holding one are masked out for every JSON row.
        words = xgr.get_bitmask_shape(1, vocab_size)[1]
        allowed = np.ones(words * 32, dtype=np.uint8)
        allowed[[i for i, raw in enumerate(info.decoded_vocab[:vocab_size]) if min(raw, default=32) < 32]] = 0
        packed = np.packbits(allowed, bitorder="little").view("<u4")  # token i: bit i % 32 of word i // 32
        self._no_control = torch.from_numpy(packed.astype(np.uint32).view(np.int32).copy())
        # xgrammar's own cache is off: this one is bounded by count and keyed by the spec's hash.
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._info = info
        self._process: CompileProcess | None = None
        if compile_timeout_s is not None:
            self._process = CompileProcess(info.serialize_json(), compile_timeout_s)
            self._process.start()  # built on the compile thread: its start delays no step
        self._cache: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the engine thread compiles, the runner's thread may read

    def compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        """The compiled grammar of ``spec``; StructuredOutputError (a 400) if xgrammar refuses it."""
        key = spec.key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        try:
            compiled = self._compile(spec)
        except StructuredOutputError:
            raise
        except CompileTimeout as exc:
            raise StructuredOutputError(f"{exc}: simplify the {spec.kind}", spec.param) from None
        except Exception as exc:  # xgrammar reports bad schemas, regexes and grammars as RuntimeError
            raise StructuredOutputError(f"unsupported {spec.kind}: {exc}", spec.param) from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        if self._process is None:
            return compile_spec(self._compiler, spec.kind, spec.value)
        serialized = self._process.compile(spec.kind, spec.value)
        return xgr.CompiledGrammar.deserialize_json(serialized, self._info)

    def close(self) -> None:
        if self._process is not None:
            self._process.close()

    def state(self, spec: StructuredOutput, output_token_ids: list[int]) -> GrammarState:
        """A fresh matcher for ``spec`` that has already accepted ``output_token_ids`` (a resumed stream)."""
        state = GrammarState(self.compile(spec), self._no_control if spec.kind.startswith("json") else None)
        for token in output_token_ids:
            if token < 0:  # a placeholder (async scheduling): the rest is not known yet
                break
            state.accept(token)
        return state

    def cached(self) -> int:
        with self._lock:
            return len(self._cache)

    def has(self, spec: StructuredOutput) -> bool:
        """Whether ``spec`` is compiled already (a lookup: the engine admits such a request at once)."""
        with self._lock:
            return spec.key in self._cache


_CompilerKey = tuple[str, int, tuple[int, ...], float | None]
_compilers: dict[_CompilerKey, GrammarCompiler] = {}
_compilers_lock = threading.Lock()


def compiler_for(
    model_path: str, vocab_size: int, eos_token_ids: tuple[int, ...], compile_timeout_s: float | None = None
) -> GrammarCompiler:
    """The model's compiler, built on first use (the vocabulary scan takes seconds: the engine builds it
    on its compile thread, engine/structured/background.py) and shared by that thread and the runner."""
    key = (model_path, vocab_size, eos_token_ids, compile_timeout_s)
    with _compilers_lock:  # one build, whichever thread asks first
        built = _compilers.get(key)
        if built is None:
            tokenizer = load_tokenizer(model_path)
            if tokenizer is None:
                raise StructuredOutputError("this model has no tokenizer: structured outputs need one")
            stops = sorted(set(eos_token_ids) | set(tokenizer.eos_token_ids))
            built = _compilers[key] = GrammarCompiler(tokenizer, vocab_size, stops, compile_timeout_s)
        return built


def _engine_key(config: EngineConfig) -> _CompilerKey:
    eos = tuple(sorted(config.model.eos_token_ids))
    return str(config.model_path), config.model.vocab_size, eos, config.grammar_compile_timeout_s


def compiler_for_engine(config: EngineConfig) -> GrammarCompiler:
    return compiler_for(*_engine_key(config))


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    return xgr.allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, indices: list[int]) -> None:
    """Set the disallowed logits of rows ``indices`` to -inf, in place, in one pass."""
    bitmask = bitmask.to(logits.device, non_blocking=True) if logits.is_cuda else bitmask
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=indices)
