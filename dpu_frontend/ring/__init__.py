"""The ring protocol v1, sans-I/O: layout record, records, both channel ends."""

from dpu_frontend.ring.dpu import DpuChannel, ReadOp, WriteOp
from dpu_frontend.ring.gpu import GpuChannel
from dpu_frontend.ring.layout import ChannelLayout, Geometry, Layout, decode_layout
from dpu_frontend.ring.records import (
    CancelRecord,
    FinishReason,
    GenerateRecord,
    ResponseRecord,
    SamplingParams,
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
    "ReadOp",
    "ResponseRecord",
    "SamplingParams",
    "WriteOp",
    "decode_layout",
]
