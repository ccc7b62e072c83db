"""The ring protocol v2, sans-I/O: layout record, records, both channel ends, the mailbox."""

from dpu_frontend.ring.dpu import DpuChannel, Poll, ReadOp, WriteOp
from dpu_frontend.ring.gpu import GpuChannel
from dpu_frontend.ring.layout import ChannelLayout, Geometry, Layout, decode_layout
from dpu_frontend.ring.records import (
    CancelRecord,
    FinishReason,
    GenerateRecord,
    ResponseRecord,
    SamplingParams,
    TokenLogprobs,
)

__all__ = [
    "CancelRecord",
    "ChannelLayout",
    "DpuChannel",
    "FinishReason",
    "GenerateRecord",
    "Geometry",
    "GpuChannel",
    "Layout",
    "Poll",
    "ReadOp",
    "ResponseRecord",
    "SamplingParams",
    "TokenLogprobs",
    "WriteOp",
    "decode_layout",
]
