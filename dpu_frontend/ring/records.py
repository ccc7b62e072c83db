"""Fixed binary records of the ring protocol v2.2 (docs/protocol.md, "Records").

Every layout here is little-endian with natural alignment, so that a CUDA
kernel reads it with plain loads into a C struct. Nothing in this module does
I/O: encoders return bytes, decoders take bytes (or a memoryview over the
peer's memory).
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, field

from dpu_frontend.errors import ProtocolError
from dpu_frontend.ring.cstruct import CStruct
from dpu_frontend.ring.layout import (
    MAX_TOP_LOGPROBS,
    REQUEST_SLOT_SIZE,
    RESPONSE_HEADER_SIZE,
    TOKEN_LOGPROBS_STRUCT,
)

#: The commit word: the record's sequence number, written last (section
#: "Memory ordering" of docs/protocol.md).
COMMIT = struct.Struct("<Q")
MAX_STOP_TOKEN_IDS = 8
#: The whole 128-byte request slot; the body is every field after ``commit``.
REQUEST_STRUCT = CStruct("dpuf_request", (
    ("commit", "Q"), ("kind", "I"), ("flags", "I"), ("request_id", "Q"),
    ("arena_offset", "Q"), ("prompt_len", "I"), ("max_tokens", "I"), ("temperature", "f"),
    ("top_p", "f"), ("top_k", "i"), ("min_p", "f"), ("seed", "Q"),
    ("presence_penalty", "f"), ("frequency_penalty", "f"), ("repetition_penalty", "f"),
    ("n_stop_token_ids", "I"), ("stop_token_ids", f"{MAX_STOP_TOKEN_IDS}I"), ("epoch", "I"),
    ("top_logprobs", "I"), ("automaton_bytes", "I"),
), REQUEST_SLOT_SIZE)
REQUEST_BODY_OFFSET = 8
#: Request record body, from byte 8 to byte 124 of the slot (then reserved zero).
REQUEST_BODY = struct.Struct("<" + REQUEST_STRUCT.codec.format[2:])
#: Response record header; token ids (or, with RESPONSE_LOGPROBS, 48-byte
#: ``dpuf_token_logprobs`` entries) follow at byte 32.
RESPONSE_STRUCT = CStruct("dpuf_response_header", (
    ("seq", "Q"), ("request_id", "Q"), ("epoch", "I"), ("n_tokens", "H"), ("finish", "B"),
    ("flags", "B"), ("n_top", "B"),
), RESPONSE_HEADER_SIZE)
RESPONSE_HEADER = RESPONSE_STRUCT.codec
TOKEN_LOGPROBS = TOKEN_LOGPROBS_STRUCT.codec
TOKEN_LOGPROBS_SIZE = TOKEN_LOGPROBS_STRUCT.size

#: Request record flags.
FLAG_IGNORE_EOS = 1 << 0
FLAG_HAS_SEED = 1 << 1
FLAG_LOGPROBS = 1 << 2  # minor version 1: log probabilities, ``top_logprobs`` alternatives
#: Minor version 2: an automaton of ``automaton_bytes`` follows the prompt in the arena.
FLAG_CONSTRAINED = 1 << 3
#: Response record flags: the payload is token entries with log probabilities.
RESPONSE_LOGPROBS = 1 << 0

U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF


class RecordKind(enum.IntEnum):
    GENERATE = 1
    CANCEL = 2


class FinishReason(enum.IntEnum):
    """Why a sequence ended; carried in the last response record of a request."""

    NONE = 0  # more records follow
    STOP = 1  # an EOS or stop token id (not included in the tokens)
    LENGTH = 2  # max_tokens reached
    CANCELLED = 3  # a cancel record arrived; the final record may carry no token
    ERROR = 4  # the GPU side could not serve it


#: Every finish reason by its value (0, 1, 2, ...: the enum's values are its indices).
_FINISHES = tuple(FinishReason)
assert all(reason == i for i, reason in enumerate(_FINISHES))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What the GPU side needs to sample a sequence. Validated by the HTTP layer."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    #: None: no log probabilities; k: the sampled token's and k alternatives (0-5).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= U32_MAX:
            raise ValueError(f"max_tokens must be in [1, {U32_MAX}], got {self.max_tokens}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop token ids fit a request record")
        if any(not 0 <= t <= U32_MAX for t in self.stop_token_ids):
            raise ValueError("stop token ids must be u32")
        if self.seed is not None and not 0 <= self.seed <= U64_MAX:
            raise ValueError("seed must be a u64")
        if not -(2**31) <= self.top_k < 2**31:
            raise ValueError("top_k must fit an i32")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] alternatives")


@dataclass(frozen=True, slots=True)
class GenerateRecord:
    request_id: int
    arena_offset: int  # byte offset of the prompt inside the channel's arena
    prompt_len: int  # in tokens (u32 each)
    params: SamplingParams
    #: Structured output: the automaton's size; it starts at the prompt's offset plus
    #: the prompt's bytes rounded up to 128 (``automaton_offset``). 0: unconstrained.
    automaton_bytes: int = 0

    @property
    def automaton_offset(self) -> int:
        """Where the automaton starts in the arena."""
        return self.arena_offset + (self.prompt_len * 4 + 127) // 128 * 128


@dataclass(frozen=True, slots=True)
class CancelRecord:
    request_id: int


RequestRecord = GenerateRecord | CancelRecord


def encode_request_body(record: RequestRecord, epoch: int) -> bytes:
    """Bytes 8..128 of a request slot. The commit word (bytes 0..8) is separate."""
    if isinstance(record, CancelRecord):
        body = REQUEST_BODY.pack(
            RecordKind.CANCEL, 0, record.request_id, 0, 0, 0,
            0.0, 0.0, 0, 0.0, 0, 0.0, 0.0, 0.0, 0, *([0] * MAX_STOP_TOKEN_IDS), epoch, 0, 0,
        )
    else:
        p = record.params
        flags = ((FLAG_IGNORE_EOS if p.ignore_eos else 0)
                 | (FLAG_HAS_SEED if p.seed is not None else 0)
                 | (FLAG_LOGPROBS if p.logprobs is not None else 0)
                 | (FLAG_CONSTRAINED if record.automaton_bytes else 0))
        stops = list(p.stop_token_ids) + [0] * (MAX_STOP_TOKEN_IDS - len(p.stop_token_ids))
        body = REQUEST_BODY.pack(
            RecordKind.GENERATE, flags, record.request_id, record.arena_offset,
            record.prompt_len, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p,
            p.seed or 0, p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
            len(p.stop_token_ids), *stops, epoch, p.logprobs or 0, record.automaton_bytes,
        )
    return body + bytes(REQUEST_SLOT_SIZE - REQUEST_BODY_OFFSET - len(body))


def decode_request(slot: bytes | memoryview, epoch: int) -> RequestRecord:
    """Decode a whole 128-byte slot whose commit word the caller already checked.

    A record written in another attachment (``epoch``) is never accepted.
    """
    (kind, flags, request_id, arena_offset, prompt_len, max_tokens, temperature, top_p,
     top_k, min_p, seed, presence, frequency, repetition, n_stop, *rest) = (
        REQUEST_BODY.unpack_from(slot, REQUEST_BODY_OFFSET)
    )
    stops, (record_epoch, top_logprobs, automaton_bytes) = (rest[:MAX_STOP_TOKEN_IDS],
                                                            rest[MAX_STOP_TOKEN_IDS:])
    if record_epoch != epoch:
        raise ProtocolError(f"request record of epoch {record_epoch} in epoch {epoch}")
    if kind == RecordKind.CANCEL:
        return CancelRecord(request_id)
    if kind != RecordKind.GENERATE:
        raise ProtocolError(f"unknown request record kind {kind}")
    if n_stop > MAX_STOP_TOKEN_IDS:
        raise ProtocolError(f"request record declares {n_stop} stop token ids")
    if max_tokens < 1:
        raise ProtocolError(f"request record {request_id} asks for max_tokens 0")
    if bool(flags & FLAG_CONSTRAINED) != bool(automaton_bytes):
        raise ProtocolError(f"request record {request_id}: automaton of {automaton_bytes} "
                            f"bytes with flags {flags:#x}")
    try:
        params = SamplingParams(
            max_tokens=max_tokens, temperature=_f32(temperature), top_p=_f32(top_p),
            top_k=top_k, min_p=_f32(min_p),
            seed=seed if flags & FLAG_HAS_SEED else None,
            presence_penalty=_f32(presence), frequency_penalty=_f32(frequency),
            repetition_penalty=_f32(repetition), stop_token_ids=tuple(stops[:n_stop]),
            ignore_eos=bool(flags & FLAG_IGNORE_EOS),
            logprobs=top_logprobs if flags & FLAG_LOGPROBS else None,
        )
    except ValueError as exc:
        raise ProtocolError(f"request record {request_id}: {exc}") from exc
    return GenerateRecord(request_id, arena_offset, prompt_len, params, automaton_bytes)


def _f32(x: float) -> float:
    # A float32 field read back: keep NaN out of the peer's sampler.
    return 0.0 if math.isnan(x) else x


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """A generated token's log probability and the most likely alternatives."""

    logprob: float  # of the token, in the model's distribution: <= 0, -inf allowed
    top: tuple[tuple[int, float], ...] = ()  # (id, log probability), most likely first


@dataclass(slots=True)
class ResponseRecord:
    request_id: int
    tokens: tuple[int, ...]
    finish: FinishReason = FinishReason.NONE
    #: With a request that asked for them: one entry per token (none for the others).
    logprobs: tuple[TokenLogprobs, ...] | None = None

    @property
    def final(self) -> bool:
        return self.finish != 0  # FinishReason.NONE; an int compare: this runs per record


def encode_response_body(record: ResponseRecord, slot_size: int, epoch: int) -> bytes:
    """Bytes 8..slot_size of a response slot; the sequence word goes in last."""
    n = len(record.tokens)
    if record.logprobs is not None:
        return _encode_logprobs_body(record, slot_size, epoch)
    capacity = (slot_size - RESPONSE_HEADER_SIZE) // 4
    if n > capacity:
        raise ValueError(f"{n} tokens do not fit a {slot_size}-byte response record")
    head = RESPONSE_STRUCT.pack(0, record.request_id, epoch, n, record.finish, 0, 0)[8:]
    return head + struct.pack(f"<{n}I", *record.tokens) + bytes((capacity - n) * 4)


def _encode_logprobs_body(record: ResponseRecord, slot_size: int, epoch: int) -> bytes:
    entries = record.logprobs or ()
    n = len(record.tokens)
    if len(entries) != n:
        raise ValueError(f"{n} tokens with {len(entries)} log probability entries")
    capacity = (slot_size - RESPONSE_HEADER_SIZE) // TOKEN_LOGPROBS_SIZE
    if n > capacity:
        raise ValueError(f"{n} tokens with log probabilities do not fit a {slot_size}-byte "
                         "response record")
    n_top = max((len(e.top) for e in entries), default=0)
    if n_top > MAX_TOP_LOGPROBS or any(len(e.top) != n_top for e in entries):
        raise ValueError(f"every token of a record carries the same number of alternatives, "
                         f"at most {MAX_TOP_LOGPROBS}")
    out = bytearray(RESPONSE_STRUCT.pack(0, record.request_id, epoch, n, record.finish,
                                         RESPONSE_LOGPROBS, n_top)[8:])
    pad = MAX_TOP_LOGPROBS - n_top
    for token, entry in zip(record.tokens, entries, strict=True):
        ids = [t for t, _ in entry.top] + [0] * pad
        lps = [lp for _, lp in entry.top] + [0.0] * pad
        out += TOKEN_LOGPROBS.pack(token, entry.logprob, *ids, *lps)
    return bytes(out) + bytes(slot_size - 8 - len(out))


def decode_response(slot: bytes | memoryview, offset: int, expected_seq: int,
                    slot_size: int, epoch: int) -> ResponseRecord:
    """Decode the record at ``offset``; its sequence word must be ``expected_seq`` and
    its epoch the attachment's: a record from an old epoch is never accepted."""
    seq, request_id, record_epoch, n, finish, flags, n_top = (
        RESPONSE_HEADER.unpack_from(slot, offset))
    if seq != expected_seq:
        raise ProtocolError(
            f"response record {expected_seq} carries sequence {seq}: the peer published an "
            "index before the record it covers"
        )
    if record_epoch != epoch:
        raise ProtocolError(
            f"response record {seq} belongs to epoch {record_epoch}, the channel is in "
            f"epoch {epoch}: a store from an earlier attachment"
        )
    if finish >= len(_FINISHES):
        raise ProtocolError(f"response record {seq}: unknown finish reason {finish}")
    reason = _FINISHES[finish]  # an index, not FinishReason(finish): this runs per record
    if flags:
        return _decode_logprobs(slot, offset, seq, request_id, n, reason, flags, n_top,
                                slot_size)
    if n > (slot_size - RESPONSE_HEADER_SIZE) // 4:
        raise ProtocolError(f"response record {seq} declares {n} tokens")
    tokens = struct.unpack_from(f"<{n}I", slot, offset + RESPONSE_HEADER_SIZE)
    return ResponseRecord(request_id, tokens, reason)


#: A response record's header and its first token id, in one unpack: the record of a
#: decode step (one token, no log probabilities) is read with it alone.
_HEADER_AND_TOKEN = struct.Struct(
    f"{RESPONSE_HEADER.format}{RESPONSE_HEADER_SIZE - RESPONSE_HEADER.size}xI")


def decode_responses(data: bytes | memoryview, count: int, first_seq: int, slot_size: int,
                     epoch: int) -> list[ResponseRecord]:
    """``decode_response`` of ``count`` consecutive slots of ``data``, the first with
    sequence ``first_seq``; a one-token record is checked and read in one unpack."""
    records: list[ResponseRecord] = []
    append = records.append
    unpack = _HEADER_AND_TOKEN.unpack_from
    finishes = _FINISHES
    known = len(finishes)
    for i in range(count):
        offset = i * slot_size
        seq, request_id, record_epoch, n, finish, flags, _, token = unpack(data, offset)
        if n == 1 and not flags and seq == first_seq + i and record_epoch == epoch \
                and finish < known:
            append(ResponseRecord(request_id, (token,), finishes[finish]))
        else:  # any other record, and every check with its error
            append(decode_response(data, offset, first_seq + i, slot_size, epoch))
    return records


def _decode_logprobs(slot: bytes | memoryview, offset: int, seq: int, request_id: int, n: int,
                     reason: FinishReason, flags: int, n_top: int,
                     slot_size: int) -> ResponseRecord:
    """A record whose tokens carry log probabilities; every value is checked: a log
    probability is a number <= 0 (-inf allowed), never NaN or positive."""
    if flags != RESPONSE_LOGPROBS:
        raise ProtocolError(f"response record {seq}: unknown flags {flags:#x}")
    if n > (slot_size - RESPONSE_HEADER_SIZE) // TOKEN_LOGPROBS_SIZE:
        raise ProtocolError(f"response record {seq} declares {n} tokens with log "
                            "probabilities")
    if n_top > MAX_TOP_LOGPROBS:
        raise ProtocolError(f"response record {seq} declares {n_top} alternatives per token")
    tokens, entries = [], []
    for i in range(n):
        token, logprob, *rest = TOKEN_LOGPROBS.unpack_from(
            slot, offset + RESPONSE_HEADER_SIZE + i * TOKEN_LOGPROBS_SIZE)
        ids, lps = rest[:n_top], rest[MAX_TOP_LOGPROBS:MAX_TOP_LOGPROBS + n_top]
        if not all(lp <= 0.0 for lp in (logprob, *lps)):  # NaN fails this too
            raise ProtocolError(f"response record {seq}: a log probability is NaN or "
                                "positive")
        tokens.append(token)
        entries.append(TokenLogprobs(logprob, tuple(zip(ids, lps, strict=True))))
    return ResponseRecord(request_id, tuple(tokens), reason, tuple(entries))
