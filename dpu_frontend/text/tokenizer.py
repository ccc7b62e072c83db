"""A Hugging Face tokenizer with what serving needs from its config.

``Vocabulary.load`` accepts a ``tokenizer.json`` file or a directory holding
one, next to an optional ``tokenizer_config.json`` (EOS token, special tokens
for chat templates, the chat template itself, context length).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, models

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
    #: At most how many characters of the input one token stands for; None when the
    #: tokenizer may drop input characters, so that no such bound exists.
    max_token_chars: int | None = None

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
                   _chat_template(config), _drops_leading_space(tokenizer),
                   max_token_chars(tokenizer))

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


#: Characters tokenized at a time when a long prompt is counted before it is encoded.
COUNT_CHUNK_CHARS = 1 << 16
#: Tokens a cut between two chunks may add to their count over the whole text's.
CUT_MARGIN = 8
_CUT_WINDOW = 1024


def count_beyond(tokenizer: Tokenizer, text: str, limit: int) -> int | None:
    """Count the tokens of ``text`` a chunk at a time, stopping as soon as there are
    more than ``limit``: then a lower bound of its count (itself above ``limit``).
    None when it may fit: encode it whole for its ids. That is also the answer, after
    the first chunk, for a text whose first chunk projects to at most twice ``limit``
    in all: counting on would cost a second pass over a text likely to fit, and
    tokenizing it whole costs about as much as counting past the limit would.

    Each cut costs the whole text at most ``CUT_MARGIN`` tokens: a cut is made before a
    space that follows a non-space, where byte-level pre-tokenizers (GPT-2's, Llama 3's,
    Qwen's) always split, so that both sides tokenize as the whole does; where the
    window has no such space (digits, CJK, one long word, a run of whitespace), the
    piece that spans the cut tokenizes differently on either side, by a token or two.
    """
    counted = cuts = start = 0
    while start < len(text):
        end = _cut(text, start + COUNT_CHUNK_CHARS)
        counted += len(encode(tokenizer, text[start:end], add_special_tokens=False))
        if counted - cuts * CUT_MARGIN > limit:
            return counted - cuts * CUT_MARGIN
        if cuts == 0 and counted * len(text) <= 2 * limit * end:
            return None
        start, cuts = end, cuts + 1
    return None


def _cut(text: str, at: int) -> int:
    """Where to end a chunk near ``at`` (see ``count_beyond``)."""
    if at >= len(text):
        return len(text)
    low = at - _CUT_WINDOW
    space = text.rfind(" ", low, at)
    while space > low and text[space - 1].isspace():
        space = text.rfind(" ", low, space)
    return space if space > low else at


#: The most code points one character decomposes into (canonically: U+1F82 into 4),
#: and the most per byte of its UTF-8 (U+01D5, 2 bytes, into 3). NFC and NFKC compose
#: at most that many input characters into one; tests/unit/test_tokenizer_bounds.py
#: checks both over all of Unicode.
MAX_DECOMPOSITION = 4
MAX_DECOMPOSITION_PER_BYTE = 1.5
#: Pre-tokenizers and split behaviours that keep every character of the input.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation",
                           "UnicodeScripts"}


def max_token_chars(tokenizer: Tokenizer) -> int | None:
    """At most how many input characters one token can stand for, or None.

    The longest entry of the vocabulary, in characters, is a bound only when no step
    drops input characters: a pre-tokenizer that splits on whitespace and throws it
    away (BERT's), an ``[UNK]`` standing for a whole unknown word, a normalizer that
    strips or replaces text (the bound is then None). NFC/NFKC compose several
    characters into one, so the bound is multiplied by the most they compose. Entries
    of a byte-level vocabulary spell bytes, one character a byte; an input character
    is one to four bytes, so their length bounds its characters too.
    """
    pre = _spec(tokenizer.pre_tokenizer)
    byte_level = "ByteLevel" in json.dumps(pre)
    model = tokenizer.model
    if not isinstance(model, models.BPE) or not (byte_level or model.byte_fallback):
        return None  # an unknown character may vanish, or many fuse into one [UNK]
    if any(t.lstrip or t.rstrip for t in tokenizer.get_added_tokens_decoder().values()):
        return None  # such a token swallows the whitespace beside it, however long
    if not _keeps_every_character(pre):
        return None
    shrink = _normalizer_shrink(_spec(tokenizer.normalizer), byte_level)
    if shrink is None:
        return None
    longest = max(len(token) for token in tokenizer.get_vocab(with_added_tokens=True))
    return math.ceil(longest * shrink)


def _spec(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's JSON, as tokenizer.json writes it."""
    return None if component is None else dict(json.loads(component.__getstate__()))


def _keeps_every_character(pre: dict[str, Any] | None) -> bool:
    if pre is None:
        return True
    if pre.get("type") == "Sequence":
        return all(_keeps_every_character(p) for p in pre.get("pretokenizers", []))
    return pre.get("type") in _KEEPING_PRE_TOKENIZERS and pre.get("behavior") != "Removed"


def _normalizer_shrink(norm: dict[str, Any] | None, byte_level: bool) -> float | None:
    """By how much the normalizer can shorten the text (1: never), or None: unbounded."""
    if norm is None:
        return 1.0
    kind = norm.get("type")
    if kind == "Sequence":
        shrink = 1.0
        for part in norm.get("normalizers", []):
            step = _normalizer_shrink(part, byte_level)
            if step is None:
                return None
            shrink *= step
        return shrink
    if kind in ("NFD", "NFKD", "Lowercase", "Prepend"):
        return 1.0  # these never shorten the text
    if kind in ("NFC", "NFKC"):
        return MAX_DECOMPOSITION_PER_BYTE if byte_level else MAX_DECOMPOSITION
    if kind == "Replace":
        pattern, content = norm.get("pattern", {}).get("String"), norm.get("content", "")
        if isinstance(pattern, str) and pattern and content:
            return max(1.0, len(pattern) / len(content))
    return None  # Strip, StripAccents, Precompiled, regex replacements: they may delete


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
