"""Incremental detokenization with ``tokenizers.decoders.DecodeStream``.

``DecodeStream`` turns one token at a time into text, holding back bytes
until they form whole characters. Three gaps are covered here:

* it has no flush: at the end, the held-back tail is computed from a full
  decode of every id (``finish``), so that the concatenated output equals
  the full decode of the continuation;
* sentencepiece decoders drop the leading space of a sequence's first
  token: the stream is primed with the prompt's last ids (``context``) and
  the text is what the generated ids add after them
  (``Vocabulary.decode_continuation``);
* on some sentencepiece vocabularies it raises "Invalid prefix encountered"
  on garbage output: the stream is replaced by a fresh one and the same id
  stepped again, so the text goes on (a restarted stream has no left
  context, so such output may differ from the full decode in spacing).
"""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from dpu_frontend.text.tokenizer import Vocabulary

log = logging.getLogger("dpu_frontend.text")


class IncrementalDetokenizer:
    def __init__(self, vocab: Vocabulary, *, context: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self._vocab = vocab
        self._tokenizer = vocab.tokenizer
        self._skip = skip_special_tokens
        self._context = list(context or ())
        self._stream = self._new_stream()
        self.ids: list[int] = []
        self._emitted: list[str] = []
        self.resets = 0

    def push(self, ids: tuple[int, ...] | list[int]) -> str:
        """Feed new ids; return the text they complete (possibly empty).

        A whole record's ids go to DecodeStream in one call (one crossing into
        Rust per record, not per token); after an "Invalid prefix" the record is
        stepped again, one id at a time, on a fresh stream.
        """
        if not ids:
            return ""
        self.ids.extend(ids)
        try:
            # One id as an int: a decode step's record, without a list to convert.
            step = ids[0] if len(ids) == 1 else list(ids)
            text = self._stream.step(self._tokenizer, step) or ""
        except Exception as exc:  # tokenizers raises a bare Exception here
            if "Invalid prefix" not in str(exc):
                raise
            text = "".join(self._restart(ids))
        if text:
            self._emitted.append(text)
        return text

    def _restart(self, ids: tuple[int, ...] | list[int]) -> list[str]:
        self.resets += 1
        self._stream = self._new_stream()
        out = []
        for token_id in ids:
            try:
                chunk = self._stream.step(self._tokenizer, token_id)
            except Exception as exc:
                if "Invalid prefix" not in str(exc):
                    raise
                self.resets += 1
                self._stream = self._new_stream()
                chunk = self._stream.step(self._tokenizer, token_id)
            if chunk:
                out.append(chunk)
        return out

    def _new_stream(self) -> DecodeStream:
        stream = DecodeStream(skip_special_tokens=self._skip)
        if self._context:
            stream.step(self._tokenizer, self._context)  # priming: its text is the prompt's
        return stream

    def finish(self) -> str:
        """The held-back tail: what ``decode(ids)`` has beyond the text already emitted."""
        full = self._vocab.decode_continuation(self._context, self.ids,
                                               skip_special_tokens=self._skip)
        emitted = "".join(self._emitted)
        if not full.startswith(emitted):
            log.debug("streamed text differs from the full decode after %d ids (%d resets)",
                      len(self.ids), self.resets)
            return ""
        tail = str(full[len(emitted):])
        if tail:
            self._emitted.append(tail)
        return tail
