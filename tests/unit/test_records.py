"""Property tests for every encoder and decoder of the ring protocol."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpu_frontend.errors import LayoutMismatch, ProtocolError
from dpu_frontend.ring import CancelRecord, FinishReason, GenerateRecord, Geometry, Layout, SamplingParams
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


def test_response_record_overflow_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        encode_response_body(ResponseRecord(1, tuple(range(9))), 64, 1)


@given(channels=st.integers(1, 4), req_slots=st.integers(1, 64), arena=st.integers(1, 64),
       sequences=st.integers(1, 32), extra=st.integers(0, 64),
       resp_slot=st.sampled_from([64, 96, 128]), instance=u64.filter(bool))
def test_layout_roundtrip(channels: int, req_slots: int, arena: int, sequences: int, extra: int,
                          resp_slot: int, instance: int) -> None:
    layout = Geometry(channels, req_slots, arena * 128, 2 * sequences + extra, resp_slot,
                      sequences).plan(instance)
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
