"""Incremental detokenization with ``tokenizers.decoders.DecodeStream``.

``DecodeStream`` turns one token at a time into text, holding back bytes
until they form whole characters. Two gaps are covered here:

* it has no flush: at the end, the held-back tail is computed from a full
  decode of every id (``finish``), so that for byte-level BPE vocabularies
  (the bundled Qwen3 among them) the concatenated output equals
  ``decode(ids)`` exactly;
* on some sentencepiece vocabularies it raises "Invalid prefix encountered"
  on garbage output: the stream is replaced by a fresh one and the same id
  stepped again, so the text goes on (a restarted stream has no left
  context, so such output may differ from the full decode in spacing).
"""

from __future__ import annotations

import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = logging.getLogger("dpu_frontend.text")


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._emitted: list[str] = []
        self.resets = 0

    def push(self, ids: tuple[int, ...] | list[int]) -> str:
        """Feed new ids; return the text they complete (possibly empty)."""
        out: list[str] = []
        for token_id in ids:
            self.ids.append(token_id)
            chunk = self._step(token_id)
            if chunk:
                out.append(chunk)
        text = "".join(out)
        if text:
            self._emitted.append(text)
        return text

    def _step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._tokenizer, token_id)
        except Exception as exc:  # tokenizers raises a bare Exception here
            if "Invalid prefix" not in str(exc):
                raise
        self.resets += 1
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        return self._stream.step(self._tokenizer, token_id)

    def finish(self) -> str:
        """The held-back tail: what ``decode(ids)`` has beyond the text already emitted."""
        full = self._tokenizer.decode(self.ids, skip_special_tokens=self._skip)
        emitted = "".join(self._emitted)
        if not full.startswith(emitted):
            log.debug("streamed text differs from the full decode after %d ids (%d resets)",
                      len(self.ids), self.resets)
            return ""
        tail = str(full[len(emitted):])
        if tail:
            self._emitted.append(tail)
        return tail

    @property
    def text(self) -> str:
        return "".join(self._emitted)
