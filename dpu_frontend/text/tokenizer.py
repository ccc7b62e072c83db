"""A Hugging Face tokenizer with what serving needs from its config.

``Vocabulary.load`` accepts a ``tokenizer.json`` file or a directory holding
one, next to an optional ``tokenizer_config.json`` (for the EOS token and the
context length).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from dpu_frontend.errors import StartupError


@dataclass(frozen=True, slots=True)
class Vocabulary:
    tokenizer: Tokenizer
    eos_token_ids: tuple[int, ...]
    model_max_length: int
    source: Path

    @classmethod
    def load(cls, path: Path) -> Vocabulary:
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            tokenizer = Tokenizer.from_file(str(file))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise StartupError(f"cannot load tokenizer {file}: {exc}") from exc
        config = _read_config(file.parent / "tokenizer_config.json")
        eos_ids = []
        for name in _eos_names(config):
            token_id = tokenizer.token_to_id(name)
            if token_id is None:
                raise StartupError(f"{file}: eos token {name!r} is not in the vocabulary")
            eos_ids.append(token_id)
        max_length = config.get("model_max_length")
        if not isinstance(max_length, int) or max_length <= 0 or max_length > 1 << 24:
            max_length = 32768  # HF writes a huge sentinel when unset
        return cls(tokenizer, tuple(eos_ids), max_length, file)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. ``encode_batch`` releases the GIL; ``encode`` does not."""
        return list(self.tokenizer.encode_batch([text])[0].ids)

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot read {path}: {exc}") from exc
    return config if isinstance(config, dict) else {}


def _eos_names(config: dict[str, Any]) -> list[str]:
    eos = config.get("eos_token")
    if isinstance(eos, dict):  # AddedToken serialisation
        eos = eos.get("content")
    return [eos] if isinstance(eos, str) else []
