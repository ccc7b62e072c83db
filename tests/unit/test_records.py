"""Property tests for every encoder and decoder of the ring protocol."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpu_frontend.errors import LayoutMismatch, ProtocolError
from dpu_frontend.ring import (
    CancelRecord,
    FinishReason,
    GenerateRecord,
    Geometry,
    Layout,
    SamplingParams,
    TokenLogprobs,
)
from dpu_frontend.ring.layout import (
    CHANNEL,
    CHANNEL_SIZE,
    HEADER,
    HEADER_SIZE,
    REQUEST_SLOT_SIZE,
    decode_header_size,
    decode_layout,
)
from dpu_frontend.ring.records import (
    REQUEST_BODY,
    REQUEST_BODY_OFFSET,
    ResponseRecord,
    decode_request,
    decode_response,
    decode_responses,
    encode_request_body,
    encode_response_body,
)

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)


def f32(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(low, high, width=32, allow_nan=False)


params_st = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 2**32 - 1), temperature=f32(0, 2), top_p=f32(0, 1),
    top_k=st.integers(-1, 2**31 - 1), min_p=f32(0, 1), seed=st.none() | u64,
    presence_penalty=f32(-2, 2), frequency_penalty=f32(-2, 2), repetition_penalty=f32(0, 2),
    stop_token_ids=st.lists(u32, max_size=8).map(tuple), ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 5),
)


def test_fixed_sizes_match_the_specification() -> None:
    assert HEADER.size <= HEADER_SIZE == 128
    assert CHANNEL.size <= CHANNEL_SIZE == 128
    assert REQUEST_BODY_OFFSET + REQUEST_BODY.size <= REQUEST_SLOT_SIZE == 128


@given(request_id=u64, arena_offset=u64, prompt_len=u32, params=params_st)
def test_generate_record_roundtrip(request_id: int, arena_offset: int, prompt_len: int,
                                   params: SamplingParams) -> None:
    record = GenerateRecord(request_id, arena_offset, prompt_len, params)
    body = encode_request_body(record, epoch=7)
    assert len(body) == REQUEST_SLOT_SIZE - REQUEST_BODY_OFFSET
    assert decode_request(bytes(8) + body, 7) == record
    with pytest.raises(ProtocolError, match="epoch 7 in epoch 8"):
        decode_request(bytes(8) + body, 8)


@given(request_id=u64)
def test_cancel_record_roundtrip(request_id: int) -> None:
    assert decode_request(bytes(8) + encode_request_body(CancelRecord(request_id), 3), 3) == (
        CancelRecord(request_id))


def test_unknown_request_kind_is_a_protocol_error() -> None:
    slot = bytearray(bytes(8) + encode_request_body(CancelRecord(1), 1))
    struct.pack_into("<I", slot, 8, 9)
    with pytest.raises(ProtocolError, match="kind 9"):
        decode_request(bytes(slot), 1)


@given(slot_size=st.sampled_from([64, 96, 128, 256]), data=st.data(), seq=u64, rid=u64,
       epoch=u32.filter(bool), finish=st.sampled_from(list(FinishReason)))
def test_response_record_roundtrip(slot_size: int, data: st.DataObject, seq: int, rid: int,
                                   epoch: int, finish: FinishReason) -> None:
    capacity = (slot_size - 32) // 4
    tokens = tuple(data.draw(st.lists(u32, max_size=capacity)))
    record = ResponseRecord(rid, tokens, finish)
    slot = struct.pack("<Q", seq) + encode_response_body(record, slot_size, epoch)
    assert len(slot) == slot_size
    assert decode_response(slot, 0, seq, slot_size, epoch) == record
    with pytest.raises(ProtocolError, match="index before the record"):
        decode_response(slot, 0, seq ^ 1, slot_size, epoch)
    with pytest.raises(ProtocolError, match="earlier attachment"):
        decode_response(slot, 0, seq, slot_size, epoch ^ 1)


@given(slot_size=st.sampled_from([64, 128]), first=st.integers(1, 2**40), epoch=u32.filter(bool),
       records=st.lists(st.tuples(u64, st.lists(u32, max_size=3).map(tuple),
                                  st.sampled_from(list(FinishReason))), max_size=6),
       fault=st.sampled_from([None, "seq", "epoch", "finish", "flags"]), at=st.integers(0, 5))
def test_decoding_slots_in_one_go_is_decoding_each(
        slot_size: int, first: int, epoch: int,
        records: list[tuple[int, tuple[int, ...], FinishReason]], fault: str | None,
        at: int) -> None:
    """``decode_responses`` (one unpack for a one-token record) accepts and refuses
    exactly what ``decode_response`` does, slot by slot, with the same error."""
    data = bytearray()
    for i, (rid, tokens, finish) in enumerate(records):
        data += struct.pack("<Q", first + i)
        data += encode_response_body(ResponseRecord(rid, tokens, finish), slot_size, epoch)
    if fault is not None and at < len(records):
        offset = at * slot_size
        field = {"seq": (0, "<Q", first + at + 1), "epoch": (16, "<I", epoch ^ 1),
                 "finish": (22, "<B", 9), "flags": (23, "<B", 2)}[fault]
        struct.pack_into(field[1], data, offset + field[0], field[2])
    slots = bytes(data)
    expected: list[ResponseRecord] | str = []
    for i in range(len(records)):
        try:
            assert isinstance(expected, list)
            expected.append(decode_response(slots, i * slot_size, first + i, slot_size, epoch))
        except ProtocolError as exc:
            expected = str(exc)
            break
    try:
        got: list[ResponseRecord] | str = decode_responses(slots, len(records), first, slot_size,
                                                           epoch)
    except ProtocolError as exc:
        got = str(exc)
    assert got == expected


def test_response_record_overflow_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        encode_response_body(ResponseRecord(1, tuple(range(9))), 64, 1)


@given(channels=st.integers(1, 4), req_slots=st.integers(1, 64), arena=st.integers(1, 64),
       sequences=st.integers(1, 32), extra=st.integers(0, 64),
       resp_slot=st.sampled_from([64, 96, 128]), instance=u64.filter(bool),
       logprobs=st.booleans())
def test_layout_roundtrip(channels: int, req_slots: int, arena: int, sequences: int, extra: int,
                          resp_slot: int, instance: int, logprobs: bool) -> None:
    logprobs = logprobs and resp_slot >= 96
    layout = Geometry(channels, req_slots, arena * 128, 2 * sequences + extra, resp_slot,
                      sequences, logprobs=logprobs).plan(instance)
    data = layout.encode()
    assert decode_header_size(data[:HEADER_SIZE]) == len(data)
    assert decode_layout(data) == layout


def _layout() -> Layout:
    return Geometry(channels=2, req_slots=4, arena_bytes=256, resp_slots=4, max_sequences=2).plan(5)


@pytest.mark.parametrize(("patch", "message"), [
    (lambda b: b.__setitem__(slice(0, 8), b"NOTARING"), "bad magic"),
    (lambda b: struct.pack_into("<H", b, 8, 1), "protocol v1.*upgrade"),
    (lambda b: struct.pack_into("<I", b, 36, 64), "descriptor size"),
    (lambda b: struct.pack_into("<Q", b, 16, 1024), "region has 1024"),
    (lambda b: struct.pack_into("<Q", b, 24, 0), "instance"),
    (lambda b: struct.pack_into("<I", b, HEADER_SIZE + 12, 64), "request slot size"),
    (lambda b: struct.pack_into("<Q", b, HEADER_SIZE + CHANNEL_SIZE, 1024), "overlaps"),
    (lambda b: struct.pack_into("<Q", b, HEADER_SIZE, 1024 + 64), "aligned"),
    (lambda b: struct.pack_into("<I", b, HEADER_SIZE + 64, 3), "two steps of 3 sequences"),
    (lambda b: struct.pack_into("<I", b, HEADER_SIZE + 68, 65), "max_prompt_tokens 65"),
    (lambda b: struct.pack_into("<I", b, HEADER_SIZE + 44, 80), "response slot size 80"),
    (lambda b: struct.pack_into("<I", b, HEADER_SIZE + 44, 64), "log probabilities"),
    (lambda b: struct.pack_into("<I", b, HEADER_SIZE + 76, 6), "max_top_logprobs 6"),
])
def test_layout_mismatches_are_named(patch: Callable[[bytearray], None], message: str) -> None:
    data = bytearray(_layout().encode())
    patch(data)
    with pytest.raises(LayoutMismatch, match=message):
        decode_layout(bytes(data))


def test_float_fields_read_back_as_float32() -> None:
    record = GenerateRecord(1, 0, 0, SamplingParams(max_tokens=1, temperature=0.1))
    decoded = decode_request(bytes(8) + encode_request_body(record, 1), 1)
    assert isinstance(decoded, GenerateRecord)
    assert math.isclose(decoded.params.temperature, 0.1, rel_tol=1e-6)


@given(request_id=u64, n_top=st.integers(0, 5), tokens=st.lists(u32, max_size=2),
       lps=st.lists(f32(-2**100, 0) | st.just(-math.inf), min_size=12, max_size=12),
       finish=st.sampled_from(list(FinishReason)), slot_size=st.sampled_from([96, 128, 160]))
def test_response_record_with_logprobs_roundtrip(request_id: int, n_top: int,
                                                 tokens: list[int], lps: list[float],
                                                 finish: FinishReason, slot_size: int) -> None:
    tokens = tokens[:(slot_size - 32) // 48]
    entries = tuple(TokenLogprobs(lps[i], tuple(((t + j) % 2**32, lps[6 + j]) for j in range(n_top)))
                    for i, t in enumerate(tokens))
    record = ResponseRecord(request_id, tuple(tokens), finish, entries)
    slot = struct.pack("<Q", 3) + encode_response_body(record, slot_size, 9)
    assert len(slot) == slot_size
    back = decode_response(slot, 0, 3, slot_size, 9)
    assert back.tokens == record.tokens and back.finish == finish
    assert back.logprobs is not None and len(back.logprobs) == len(tokens)
    for got, want in zip(back.logprobs, entries, strict=True):
        assert got.logprob == want.logprob  # f32 values survive exactly
        assert got.top == want.top


def test_a_record_without_logprobs_has_none() -> None:
    slot = struct.pack("<Q", 1) + encode_response_body(ResponseRecord(4, (1, 2)), 96, 1)
    assert decode_response(slot, 0, 1, 96, 1).logprobs is None


def _logprob_slot(**changes: object) -> bytearray:
    record = ResponseRecord(4, (11,), FinishReason.NONE, (TokenLogprobs(-0.25, ((11, -0.25),)),))
    slot = bytearray(struct.pack("<Q", 1) + encode_response_body(record, 96, 1))
    fields = {"flags": (23, "<B"), "n_top": (24, "<B"), "n_tokens": (20, "<H"),
              "logprob": (36, "<f"), "top_logprob": (60, "<f")}
    for name, value in changes.items():
        offset, fmt = fields[name]
        struct.pack_into(fmt, slot, offset, value)
    return slot


@pytest.mark.parametrize(("changes", "message"), [
    ({"flags": 2}, "unknown flags"),
    ({"n_top": 6}, "6 alternatives"),
    ({"n_tokens": 2}, "2 tokens with log probabilities"),
    ({"logprob": math.nan}, "NaN or positive"),
    ({"logprob": 0.5}, "NaN or positive"),
    ({"top_logprob": math.nan}, "NaN or positive"),
])
def test_bad_logprob_records_are_protocol_errors(changes: dict[str, object], message: str) -> None:
    decode_response(bytes(_logprob_slot()), 0, 1, 96, 1)  # the unchanged record is fine
    with pytest.raises(ProtocolError, match=message):
        decode_response(bytes(_logprob_slot(**changes)), 0, 1, 96, 1)


def test_logprob_records_refuse_what_they_cannot_carry() -> None:
    entry = TokenLogprobs(-1.0, ((1, -1.0),))
    with pytest.raises(ValueError, match="do not fit"):
        encode_response_body(ResponseRecord(1, (1, 2), logprobs=(entry, entry)), 96, 1)
    with pytest.raises(ValueError, match="entries"):
        encode_response_body(ResponseRecord(1, (1, 2), logprobs=(entry,)), 160, 1)
    with pytest.raises(ValueError, match="same number"):
        encode_response_body(ResponseRecord(1, (1, 2), logprobs=(entry, TokenLogprobs(-1.0))),
                             160, 1)


def test_a_minor_0_layout_offers_no_feature() -> None:
    """A v2.0 peer's reserved bytes say nothing: even a stray bit there is no feature."""
    layout = Geometry(channels=1, logprobs=True).plan(7)
    data = bytearray(layout.encode())
    struct.pack_into("<H", data, 10, 0)  # version_minor 0
    ch = decode_layout(bytes(data)).channels[0]
    assert not ch.logprobs and ch.max_top_logprobs == 0
    assert Geometry(channels=1).plan(7).channels[0].logprobs


def test_the_geometry_refuses_logprobs_in_small_slots() -> None:
    with pytest.raises(ValueError, match="no-logprobs"):
        Geometry(resp_slot_size=64)
    assert not Geometry(resp_slot_size=64, logprobs=False).plan(1).channels[0].logprobs
