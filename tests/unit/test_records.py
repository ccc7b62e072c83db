"""Property tests for every encoder and decoder of the ring protocol."""

from __future__ import annotations

import math
import struct

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
    assert CHANNEL.size == CHANNEL_SIZE == 64
    assert REQUEST_BODY_OFFSET + REQUEST_BODY.size <= REQUEST_SLOT_SIZE == 128


@given(request_id=u64, arena_offset=u64, prompt_len=u32, params=params_st)
def test_generate_record_roundtrip(request_id: int, arena_offset: int, prompt_len: int,
                                   params: SamplingParams) -> None:
    record = GenerateRecord(request_id, arena_offset, prompt_len, params)
    body = encode_request_body(record)
    assert len(body) == REQUEST_SLOT_SIZE - REQUEST_BODY_OFFSET
    assert decode_request(bytes(8) + body) == record


@given(request_id=u64)
def test_cancel_record_roundtrip(request_id: int) -> None:
    assert decode_request(bytes(8) + encode_request_body(CancelRecord(request_id))) == (
        CancelRecord(request_id))


def test_unknown_request_kind_is_a_protocol_error() -> None:
    slot = bytearray(bytes(8) + encode_request_body(CancelRecord(1)))
    struct.pack_into("<I", slot, 8, 9)
    with pytest.raises(ProtocolError, match="kind 9"):
        decode_request(bytes(slot))


@given(slot_size=st.sampled_from([32, 64, 128, 256]), data=st.data(), seq=u64, rid=u64,
       finish=st.sampled_from(list(FinishReason)))
def test_response_record_roundtrip(slot_size: int, data: st.DataObject, seq: int, rid: int,
                                   finish: FinishReason) -> None:
    capacity = (slot_size - 24) // 4
    tokens = tuple(data.draw(st.lists(u32, max_size=capacity)))
    record = ResponseRecord(rid, tokens, finish)
    slot = struct.pack("<Q", seq) + encode_response_body(record, slot_size)
    assert len(slot) == slot_size
    assert decode_response(slot, 0, seq, slot_size) == record
    with pytest.raises(ProtocolError):
        decode_response(slot, 0, seq ^ 1, slot_size)


def test_response_record_overflow_is_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        encode_response_body(ResponseRecord(1, tuple(range(3))), 32)


@given(channels=st.integers(1, 4), req_slots=st.integers(1, 64), arena=st.integers(1, 4096),
       resp_slots=st.integers(2, 64), resp_slot=st.sampled_from([32, 64, 120]), instance=u64.filter(bool))
def test_layout_roundtrip(channels: int, req_slots: int, arena: int, resp_slots: int,
                          resp_slot: int, instance: int) -> None:
    layout = Geometry(channels, req_slots, arena * 4, resp_slots, resp_slot).plan(instance)
    data = layout.encode()
    assert decode_header_size(data[:HEADER_SIZE]) == len(data)
    assert decode_layout(data) == layout


def _layout() -> Layout:
    return Geometry(channels=2, req_slots=4, arena_bytes=64, resp_slots=4).plan(5)


@pytest.mark.parametrize(("patch", "message"), [
    (lambda b: b.__setitem__(slice(0, 8), b"NOTARING"), "bad magic"),
    (lambda b: struct.pack_into("<H", b, 8, 2), "protocol v2"),
    (lambda b: struct.pack_into("<I", b, 36, 48), "descriptor size"),
    (lambda b: struct.pack_into("<Q", b, 16, 1024), "region has 1024"),
    (lambda b: struct.pack_into("<Q", b, 24, 0), "instance"),
    (lambda b: struct.pack_into("<I", b, HEADER_SIZE + 12, 64), "request slot size"),
    (lambda b: struct.pack_into("<Q", b, HEADER_SIZE + CHANNEL_SIZE, 1024), "overlaps"),
    (lambda b: struct.pack_into("<Q", b, HEADER_SIZE, 1000), "aligned"),
])
def test_layout_mismatches_are_named(patch: object, message: str) -> None:
    data = bytearray(_layout().encode())
    patch(data)  # type: ignore[operator]
    with pytest.raises(LayoutMismatch, match=message):
        decode_layout(bytes(data))


def test_float_fields_read_back_as_float32() -> None:
    record = GenerateRecord(1, 0, 0, SamplingParams(max_tokens=1, temperature=0.1))
    decoded = decode_request(bytes(8) + encode_request_body(record))
    assert isinstance(decoded, GenerateRecord)
    assert math.isclose(decoded.params.temperature, 0.1, rel_tol=1e-6)
