"""A Hugging Face tokenizer with what serving needs from its config.

``Vocabulary.load`` accepts a ``tokenizer.json`` file or a directory holding
one, next to an optional ``tokenizer_config.json`` (EOS token, special tokens
for chat templates, the chat template itself, context length).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from dpu_frontend.errors import StartupError

#: Prompt ids a detokenizer is primed with, for vocabularies whose decoder
#: drops the leading space of the first token (sentencepiece/Metaspace).
CONTEXT_IDS = 4
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                       "cls_token", "mask_token")


@dataclass(frozen=True, slots=True)
class Vocabulary:
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    model_max_length: int
    source: Path
    special_tokens: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    needs_context: bool = False

    @classmethod
    def load(cls, path: Path) -> Vocabulary:
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise StartupError(f"cannot load tokenizer {file}: {exc}") from exc
        config = _read_config(file.parent / "tokenizer_config.json")
        special = _special_tokens(config)
        eos_ids = []
        eos = special.get("eos_token")
        if isinstance(eos, str):
            token_id = tokenizer.token_to_id(eos)
            if token_id is None:
                raise StartupError(f"{file}: eos token {eos!r} is not in the vocabulary")
            eos_ids.append(token_id)
        max_length = config.get("model_max_length")
        if not isinstance(max_length, int) or max_length <= 0 or max_length > 1 << 24:
            max_length = 32768  # HF writes a huge sentinel when unset
        return cls(tokenizer, tuple(eos_ids), max_length, file, special,
                   _chat_template(config), _drops_leading_space(tokenizer))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return encode(self.tokenizer, text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def context(self, prompt: list[int]) -> list[int]:
        """The prompt ids a continuation is decoded after (none for byte-level BPE).

        None either when the prompt ends inside a character: a stream primed with
        broken bytes would emit their replacement characters as generated text.
        """
        if not self.needs_context:
            return []
        context = prompt[-CONTEXT_IDS:]
        return [] if self.decode(context).endswith("\ufffd") else context

    def decode_continuation(self, context: list[int], ids: list[int], *,
                            skip_special_tokens: bool = True) -> str:
        """The text ``ids`` add after ``context``: what the model wrote, spaces included."""
        if not context:
            return self.decode(ids, skip_special_tokens=skip_special_tokens)
        before = self.decode(context, skip_special_tokens=skip_special_tokens)
        full = self.decode(context + ids, skip_special_tokens=skip_special_tokens)
        if full.startswith(before):
            return full[len(before):]
        return self.decode(ids, skip_special_tokens=skip_special_tokens)


def encode(tokenizer: Tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text``. ``encode_batch`` releases the GIL; ``encode`` does not."""
    return list(tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot read {path}: {exc}") from exc
    return config if isinstance(config, dict) else {}


def _token_text(value: Any) -> Any:
    if isinstance(value, dict):  # AddedToken serialisation
        return value.get("content")
    if isinstance(value, list):
        return [_token_text(v) for v in value]
    return value


def _special_tokens(config: dict[str, Any]) -> dict[str, Any]:
    """What HF passes to chat templates: special token strings by role."""
    special = {key: _token_text(config[key]) for key in _SPECIAL_TOKEN_KEYS if key in config}
    if "additional_special_tokens" in config:
        special["additional_special_tokens"] = _token_text(config["additional_special_tokens"])
    return special


def _chat_template(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _drops_leading_space(tokenizer: Tokenizer) -> bool:
    """True when decoding a word token alone loses its leading space (sentencepiece)."""
    ids = tokenizer.encode("a b", add_special_tokens=False).ids
    return len(ids) >= 2 and not tokenizer.decode(ids[1:]).startswith(" ")
