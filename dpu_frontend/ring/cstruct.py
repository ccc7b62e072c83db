"""Fixed binary structures described once, by field name, as ``ring_protocol.h`` has them.

Each ``CStruct`` names its C type and lists its fields in declaration order
with their ``struct`` codes; trailing reserved bytes are padding. The codecs
pack and unpack through it, and the CI test that compiles the C header
(tests/unit/test_c_header.py) compares every size and field offset with the
compiler's, so the Python and C descriptions of a record cannot drift apart.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CStruct:
    c_name: str
    fields: tuple[tuple[str, str], ...]  # (name, struct code) in declaration order
    size: int  # sizeof, reserved bytes included
    codec: struct.Struct = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        codec = struct.Struct("<" + "".join(code for _, code in self.fields))
        if codec.size > self.size:
            raise ValueError(f"{self.c_name}: fields need {codec.size} bytes, size is {self.size}")
        object.__setattr__(self, "codec", codec)

    @property
    def offsets(self) -> dict[str, int]:
        """Each field's byte offset (what C's ``offsetof`` says)."""
        out, fmt = {}, "<"
        for name, code in self.fields:
            out[name] = struct.calcsize(fmt)
            fmt += code
        return out

    def offset(self, name: str) -> int:
        return self.offsets[name]

    def pack(self, *values: object) -> bytes:
        """The whole structure, reserved bytes zero."""
        return self.codec.pack(*values) + bytes(self.size - self.codec.size)

    def unpack_from(self, data: bytes | memoryview | bytearray, offset: int = 0) -> tuple[object, ...]:
        return self.codec.unpack_from(data, offset)
