"""What one token id stands for, as log probabilities show it: its exact bytes and its text.

A generated token is often part of a character (a byte-level BPE splits
emoji and accented letters across tokens), so a token's text alone loses
information; OpenAI's answers carry both: ``token``, the text (a partial
character shows as U+FFFD), and ``bytes``, the exact UTF-8 bytes.

The bytes come from the vocabulary itself where its decoder says how:

* byte-level BPE (GPT-2, Qwen, Llama 3): each character of a token's string
  stands for one byte (GPT-2's printable mapping), reversed here;
* sentencepiece pieces (``▁`` for a space, ``<0xAB>`` byte fallback);
* anything else: the token decoded alone.

Added tokens (``<|im_end|>``) are their content. Results are cached per id.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer

#: Sentencepiece's word boundary, a space in the text.
SPIECE_SPACE = "\u2581"


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's mapping from the printable character each byte is written as, to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return {c: b for b, c in chars.items()}


class TokenBytes:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        # The decoder's own JSON (its pickled state), not the whole vocabulary's: that
        # parse would cost a few hundred milliseconds and tens of megabytes of heap.
        decoder = tokenizer.decoder
        decoders = _decoder_types(json.loads(decoder.__getstate__()) if decoder else None)
        self._byte_level = byte_level_alphabet() if "ByteLevel" in decoders else None
        self._pieces = "Metaspace" in decoders or "ByteFallback" in decoders
        self._added = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items()}
        self._cache: dict[int, tuple[str, bytes]] = {}

    def get(self, token_id: int) -> tuple[str, bytes] | None:
        """``(text, bytes)`` of a token; None for an id outside the vocabulary."""
        known = self._cache.get(token_id)
        if known is None:
            raw = self._bytes(token_id)
            if raw is None:
                return None
            known = self._cache[token_id] = (raw.decode("utf-8", errors="replace"), raw)
        return known

    def _bytes(self, token_id: int) -> bytes | None:
        added = self._added.get(token_id)
        if added is not None:
            return added.encode()
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return None
        if self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        if self._pieces:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])
            return piece.replace(SPIECE_SPACE, " ").encode()
        return str(self._tokenizer.decode([token_id], skip_special_tokens=False)).encode()


def _decoder_types(spec: Any) -> set[str]:
    """The ``type`` of a decoder and of every decoder inside a ``Sequence``."""
    if not isinstance(spec, dict):
        return set()
    found = {str(spec.get("type"))}
    for inner in spec.get("decoders") or ():
        found |= _decoder_types(inner)
    return found
