"""Incremental detokenization whose concatenated output equals the full decode.

``DecodeStream`` turns one token at a time into text, holding back bytes
until they form whole characters. Two gaps are covered here:

* it has no flush: at the end the held-back tail is computed from a full
  decode of every id (``finish``);
* on some sentencepiece vocabularies it raises "Invalid prefix encountered"
  on garbage output: the stream is dropped and this request continues by
  diffing full decodes (quadratic, but only for such output).
"""

from __future__ import annotations

import logging

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

log = logging.getLogger("dpu_frontend.text")

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._emitted: list[str] = []

    def push(self, ids: tuple[int, ...] | list[int]) -> str:
        """Feed new ids; return the text they complete (possibly empty)."""
        out: list[str] = []
        for token_id in ids:
            self.ids.append(token_id)
            if self._stream is None:
                continue
            try:
                chunk = self._stream.step(self._tokenizer, token_id)
            except Exception as exc:  # tokenizers raises a bare Exception here
                if "Invalid prefix" not in str(exc):
                    raise
                log.debug("DecodeStream reset after %d ids: %s", len(self.ids), exc)
                self._stream = None
                continue
            if chunk:
                out.append(chunk)
        text = "".join(out)
        if self._stream is None:
            text += self._diff(final=False)
        self._record(text)
        return text

    def finish(self) -> str:
        """The held-back tail, so that all output equals ``decode(ids)``."""
        tail = self._diff(final=True)
        self._record(tail)
        return tail

    def _diff(self, *, final: bool) -> str:
        full = self._tokenizer.decode(self.ids, skip_special_tokens=self._skip)
        emitted = "".join(self._emitted)
        if not full.startswith(emitted):
            log.warning("detokenizer diverged from the full decode after %d ids", len(self.ids))
            return ""
        new = full[len(emitted):]
        if not final and new.endswith(REPLACEMENT):
            return ""  # an incomplete UTF-8 sequence: wait for the next id
        return new

    def _record(self, text: str) -> None:
        if text:
            self._emitted.append(text)

    @property
    def text(self) -> str:
        return "".join(self._emitted)
