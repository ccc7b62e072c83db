"""Log probabilities in OpenAI's two shapes: chat's ``content`` list, completions' columns.

JSON has no -inf: a token whose probability underflows gets OpenAI's own
floor, -9999.0, as OpenAI's API answers it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dpu_frontend.engine.service import TokenLogprob
from dpu_frontend.errors import PeerError
from dpu_frontend.text.token_bytes import TokenBytes

LOGPROB_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _token(tokens: TokenBytes, token_id: int) -> tuple[str, bytes]:
    known = tokens.get(token_id)
    if known is None:
        raise PeerError(f"GPU peer sent token id {token_id}, outside the vocabulary")
    return known


def chat_logprobs(tokens: TokenBytes, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion (or of one chunk of its stream)."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = _token(tokens, token_id)
        return {"token": text, "logprob": _value(logprob), "bytes": list(raw)}

    return {"content": [one(e.token, e.logprob) | {"top_logprobs": [one(*alt) for alt in e.top]}
                        for e in entries],
            "refusal": None}


def completion_logprobs(tokens: TokenBytes, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """``choices[i].logprobs`` of a (legacy) completion, or of one chunk of its stream."""
    return {
        "tokens": [_token(tokens, e.token)[0] for e in entries],
        "token_logprobs": [_value(e.logprob) for e in entries],
        "top_logprobs": [{_token(tokens, t)[0]: _value(lp) for t, lp in e.top} for e in entries],
        "text_offset": [e.offset for e in entries],
    }
