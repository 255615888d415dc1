"""A checkpoint's tokenizer: ``tokenizer.json`` plus the HF side files that say how to use it.

Torch-free on purpose: the gateway imports this module in an image without torch.

What comes from where, as in HF transformers:
  * tokenizer.json            the vocabulary, merges, pre/post-processing and decoder;
  * tokenizer_config.json     bos/eos token strings, add_bos_token, chat_template, model_max_length;
  * chat_template.jinja/.json a template kept outside tokenizer_config.json (newer checkpoints);
  * generation_config.json    the eos ids generation stops at (may be several), else config.json's.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend

# HF uses int(1e30) for "no limit"; anything this large is treated as no limit.
_NO_MAX_LENGTH = 10**12


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_str(value: Any) -> str | None:
    # Special tokens appear either as plain strings or as serialised AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [int(v) for v in value if isinstance(v, int)]
    return []


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, > and & for HTML; templates expect plain JSON (tool schemas).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    # Llama 3.x templates print today's date in the system prompt.
    return datetime.now().strftime(fmt)


def _pick_template(raw: Any) -> str | None:
    # tokenizer_config.json may hold a list of named templates; "default" is the chat one.
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        raw = named.get("default") or next(iter(named.values()), None)
    return raw if isinstance(raw, str) else None


def _text_of(content: Any) -> str:
    """Message content as text: a string, or OpenAI-style parts of which the text parts count."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return "" if content is None else str(content)


class Tokenizer:
    """Encode, decode and chat-format text for one checkpoint."""

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | None = None,
        model_max_length: int | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self._bos_id = backend.token_to_id(bos_token) if bos_token else None
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        extra = list(extra_eos_token_ids)
        self._eos_id = eos_id if eos_id is not None else (extra[0] if extra else None)
        self._eos_ids = tuple(dict.fromkeys(i for i in [self._eos_id, *extra] if i is not None))
        # tokenizer.json's post-processor, when it has one, decides what encode adds (HF transformers 5
        # ignores add_bos_token then). Without one, add_bos_token / add_eos_token decide, as HF 4's
        # Llama tokenizers did for checkpoints whose tokenizer.json leaves bos out.
        self._flags_decide = backend.post_processor is None
        self._add_bos = bool(add_bos_token) and self._bos_id is not None
        self._add_eos = bool(add_eos_token) and self._eos_id is not None
        if not self._flags_decide:
            probe = backend.encode("", add_special_tokens=True).ids
            self._add_bos = self._bos_id is not None and probe[:1] == [self._bos_id]
        self._special_ids = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self._special_ids.update(i for i in (self._bos_id, *self._eos_ids) if i is not None)
        self._jinja: jinja2.Template | None = None

    # ---- vocabulary ----------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added tokens included."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_id(self) -> int | None:
        """The primary eos id (tokenizer_config's eos_token, else generation_config's first)."""
        return self._eos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id generation should stop at: eos_token_id first, then generation_config's others."""
        return self._eos_ids

    @property
    def all_special_ids(self) -> set[int]:
        return set(self._special_ids)

    @property
    def backend(self) -> _Backend:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    # ---- encode / decode -----------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not (add_special_tokens and self._flags_decide):
            # The post-processor adds what it adds; _add_bos only mirrors it (for the chat fallback).
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if self._add_bos and self._bos_id is not None:
            ids = [self._bos_id, *ids]
        if self._add_eos and self._eos_id is not None:
            ids = [*ids, self._eos_id]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """The vocabulary strings of ``ids`` (byte-level tokens look like 'Ġthe'); None if unknown."""
        return [self._backend.id_to_token(i) for i in ids]

    # ---- chat ----------------------------------------------------------------------------
    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` as the model's prompt text.

        The text already carries the template's special tokens (bos included where the template writes
        it), so encode it with ``add_special_tokens=False``. Without a template, a plain
        "role: content" transcript is used, starting with bos when this tokenizer adds one.
        Template errors (``raise_exception`` included) raise ``jinja2.TemplateError``.
        """
        if self.chat_template is None:
            lines = [f"{m.get('role', 'user')}: {_text_of(m.get('content'))}" for m in messages]
            if add_generation_prompt:
                lines.append("assistant:")
            prefix = self.bos_token if self._add_bos and self.bos_token else ""
            return prefix + "\n".join(lines)
        if self._jinja is None:
            # Sandboxed: templates come with downloaded checkpoints and must not reach Python objects.
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            self._jinja = env.from_string(self.chat_template)
        variables = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs}
        return self._jinja.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)


def load_tokenizer(path: str | Path) -> Tokenizer | None:
    """The tokenizer of the checkpoint at ``path``; None when it has no tokenizer.json.

    Without one the engine serves token-id prompts only. A ``.gguf`` file reads from its converted copy.
    """
    from engine.models.gguf import local_tokenizer_files

    root = local_tokenizer_files(path)
    if not (root / "tokenizer.json").is_file():
        return None
    backend = _Backend.from_file(str(root / "tokenizer.json"))
    tok_cfg = _read_json(root / "tokenizer_config.json")
    gen_cfg = _read_json(root / "generation_config.json")
    model_cfg = _read_json(root / "config.json")

    # As in HF, a separate template file takes priority over tokenizer_config.json's entry.
    if (root / "chat_template.jinja").is_file():
        template: str | None = (root / "chat_template.jinja").read_text(encoding="utf-8")
    else:
        template = _pick_template(_read_json(root / "chat_template.json").get("chat_template"))
    if template is None:
        template = _pick_template(tok_cfg.get("chat_template"))

    bos = _token_str(tok_cfg.get("bos_token"))
    eos = _token_str(tok_cfg.get("eos_token"))
    # The model's own files know its ids when tokenizer_config.json names no token.
    gen_eos = _as_ids(gen_cfg.get("eos_token_id")) or _as_ids(model_cfg.get("eos_token_id"))
    if bos is None:
        bos_ids = _as_ids(gen_cfg.get("bos_token_id")) or _as_ids(model_cfg.get("bos_token_id"))
        bos = backend.id_to_token(bos_ids[0]) if bos_ids else None
    max_len = tok_cfg.get("model_max_length")
    max_len = int(max_len) if isinstance(max_len, int | float) and max_len < _NO_MAX_LENGTH else None
    add_bos, add_eos = tok_cfg.get("add_bos_token"), tok_cfg.get("add_eos_token")
    return Tokenizer(
        backend,
        bos_token=bos,
        eos_token=eos,
        add_bos_token=None if add_bos is None else bool(add_bos),
        add_eos_token=None if add_eos is None else bool(add_eos),
        chat_template=template,
        model_max_length=max_len,
        extra_eos_token_ids=gen_eos,
    )
