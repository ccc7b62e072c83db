"""GGUF files (llama.cpp's format; https://github.com/ggml-org/ggml, docs/gguf.md): the
header read and checked before anything loads.

A GGUF file is a header (magic, version, tensor and metadata counts), the metadata
(typed key-value pairs: the architecture, its shapes, the tokenizer), one record per
tensor (name, dimensions, element type, offset), then the tensors' data, each at an
aligned offset. ``GgufFile.parse`` checks every field against the file it came from:
counts and lengths that fit the bytes that are there, types this engine reads, tensors
whose data lie inside the file, aligned and not overlapping. A file that fails any of
it raises ``GgufError`` naming what and where, before one tensor is read.

Both sides read GGUF files, so the format sits below both (``tests/unit/test_layers.py``):
the daemon's setup builds a file's tokenizer (``text/gguf_tokenizer.py``), the model
peer reads its weights (``model/gguf_checkpoint.py``, which dequantizes them with
numpy). The standard library only: numpy is not the daemon's.

Dimensions are kept as GGUF lists them, fastest first (ggml's ``ne``); ``shape`` is
numpy's order, slowest first: a weight of ne = [K, N] is an [N, K] array, HF's layout.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

#: What a file's bytes come in: read, or mapped.
Buffer = bytes | bytearray | mmap.mmap

MAGIC = b"GGUF"
VERSIONS = (2, 3)
#: ``general.alignment`` when the file does not set it.
DEFAULT_ALIGNMENT = 32
#: Bounds on what a header may claim, far past any real file: a corrupt count fails
#: here, not in an allocation.
MAX_TENSORS = 1 << 20
MAX_METADATA = 1 << 20
MAX_DIMS = 4
MAX_STRING = 1 << 24


class GgufError(ValueError):
    """A GGUF file this reader refuses, with the reason."""


class ValueType(IntEnum):
    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


#: The struct code of each fixed-size metadata type (little-endian).
_SCALARS = {ValueType.UINT8: "B", ValueType.INT8: "b", ValueType.UINT16: "H",
            ValueType.INT16: "h", ValueType.UINT32: "I", ValueType.INT32: "i",
            ValueType.FLOAT32: "f", ValueType.BOOL: "?", ValueType.UINT64: "Q",
            ValueType.INT64: "q", ValueType.FLOAT64: "d"}


class TensorType(IntEnum):
    """The ggml element types this engine reads (ggml's numbering)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    BF16 = 30


#: Elements per block and bytes per block of each type.
BLOCKS: dict[TensorType, tuple[int, int]] = {
    TensorType.F32: (1, 4), TensorType.F16: (1, 2), TensorType.BF16: (1, 2),
    TensorType.Q8_0: (32, 34), TensorType.Q4_0: (32, 18), TensorType.Q4_1: (32, 20),
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    #: GGUF's order, fastest-varying first (ggml's ``ne``).
    dims: tuple[int, ...]
    type: TensorType
    #: From the start of the data section.
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        """numpy's order: slowest first."""
        return tuple(reversed(self.dims))

    @property
    def elements(self) -> int:
        return math.prod(self.dims)

    @property
    def nbytes(self) -> int:
        per_block, block_bytes = BLOCKS[self.type]
        return self.elements // per_block * block_bytes


class _Cursor:
    """Reads the header's fields in order, each checked against the bytes left. Fields
    are copied out (``struct.unpack_from``): no view of a mapped file outlives the
    parse, so the map closes whenever its owner says."""

    def __init__(self, data: Buffer) -> None:
        self.data = data
        self.size = len(data)
        self.at = 0

    def take(self, n: int, what: str) -> int:
        """Where the next ``n`` bytes start; GgufError if the file ends before them."""
        if n < 0 or self.at + n > self.size:
            raise GgufError(f"{what} at byte {self.at}: {n} bytes past the end of the file "
                            f"({self.size} bytes)")
        self.at += n
        return self.at - n

    def scalar(self, code: str, what: str) -> Any:
        at = self.take(struct.calcsize(code), what)
        return struct.unpack_from("<" + code, self.data, at)[0]

    def string(self, what: str) -> str:
        n = self.scalar("Q", what)
        if n > MAX_STRING:
            raise GgufError(f"{what} at byte {self.at}: a string of {n} bytes")
        at = self.take(n, what)
        try:
            return bytes(self.data[at:at + n]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GgufError(f"{what}: not UTF-8 ({exc.reason})") from None

    def value(self, kind: int, what: str) -> Any:
        try:
            vtype = ValueType(kind)
        except ValueError:
            raise GgufError(f"{what}: unknown value type {kind}") from None
        if vtype == ValueType.STRING:
            return self.string(what)
        if vtype == ValueType.ARRAY:
            item = self.scalar("I", what)
            count = self.scalar("Q", what)
            if count > self.size - self.at:  # every element takes a byte or more
                raise GgufError(f"{what}: an array of {count} elements in "
                                f"{self.size - self.at} bytes")
            if item in _SCALARS:
                code = f"<{count}{_SCALARS[ValueType(item)]}"
                return list(struct.unpack_from(code, self.data,
                                               self.take(struct.calcsize(code), what)))
            return [self.value(item, what) for _ in range(count)]
        return self.scalar(_SCALARS[vtype], what)


@dataclass(frozen=True)
class GgufFile:
    """A parsed, checked GGUF file: its metadata, its tensors and their bytes (a context
    manager: ``close`` unmaps a file ``open_gguf`` mapped)."""

    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    alignment: int
    #: Where the data section starts, from the file's start.
    data_start: int
    data: Buffer

    @classmethod
    def parse(cls, data: Buffer) -> GgufFile:
        """The header of ``data`` (a whole GGUF file), checked; GgufError if it is not
        a GGUF file this reader can load."""
        cur = _Cursor(data)
        magic = bytes(data[cur.take(4, "the magic"):4])
        if magic != MAGIC:
            raise GgufError(f"not a GGUF file (magic {magic!r}, want {MAGIC!r})")
        version = cur.scalar("I", "the version")
        if version not in VERSIONS:
            raise GgufError(f"GGUF version {version}; this reader takes "
                            f"{', '.join(map(str, VERSIONS))}")
        n_tensors = cur.scalar("Q", "the tensor count")
        n_kv = cur.scalar("Q", "the metadata count")
        if n_tensors > MAX_TENSORS or n_kv > MAX_METADATA:
            raise GgufError(f"{n_tensors} tensors and {n_kv} metadata entries: a corrupt "
                            "header")
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = cur.string(f"metadata key {i}")
            if key in metadata:
                raise GgufError(f"metadata key {key!r} twice")
            metadata[key] = cur.value(cur.scalar("I", key), key)
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise GgufError(f"general.alignment {alignment!r} is not a power of two")
        infos = [cls._tensor_info(cur, i) for i in range(n_tensors)]
        data_start = -(-cur.at // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        end_of_last = 0
        for info in sorted(infos, key=lambda t: t.offset):
            if info.name in tensors:
                raise GgufError(f"tensor {info.name!r} twice")
            if info.offset % alignment:
                raise GgufError(f"tensor {info.name!r} at offset {info.offset}, not a "
                                f"multiple of the alignment {alignment}")
            if info.offset < end_of_last:
                raise GgufError(f"tensor {info.name!r} overlaps the one before it")
            end_of_last = info.offset + info.nbytes
            if data_start + end_of_last > cur.size:
                raise GgufError(f"tensor {info.name!r} ends at byte {data_start + end_of_last}, "
                                f"past the end of the file ({cur.size} bytes): truncated?")
            tensors[info.name] = info
        return cls(version, metadata, {t.name: t for t in infos}, alignment, data_start, data)

    @staticmethod
    def _tensor_info(cur: _Cursor, i: int) -> TensorInfo:
        name = cur.string(f"tensor {i}'s name")
        n_dims = cur.scalar("I", name)
        if not 1 <= n_dims <= MAX_DIMS:
            raise GgufError(f"tensor {name!r}: {n_dims} dimensions")
        dims = tuple(cur.scalar("Q", name) for _ in range(n_dims))
        kind = cur.scalar("I", name)
        offset = cur.scalar("Q", name)
        try:
            ttype = TensorType(kind)
        except ValueError:
            raise GgufError(f"tensor {name!r}: ggml type {kind} is not one this engine "
                            f"reads ({', '.join(t.name for t in TensorType)})") from None
        if any(d < 1 for d in dims) or math.prod(dims) > 2**48:
            raise GgufError(f"tensor {name!r}: dimensions {list(dims)}")
        per_block = BLOCKS[ttype][0]
        if dims[0] % per_block:
            raise GgufError(f"tensor {name!r}: rows of {dims[0]} elements in {ttype.name} "
                            f"blocks of {per_block}")
        return TensorInfo(name, dims, ttype, offset)

    def raw(self, name: str) -> bytes:
        """A tensor's bytes, as stored."""
        info = self.tensors[name]
        start = self.data_start + info.offset
        return bytes(self.data[start:start + info.nbytes])

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors.values())

    def close(self) -> None:
        """Unmap the file, if ``open_gguf`` mapped it (no view of it may be left)."""
        if isinstance(self.data, mmap.mmap):
            self.data.close()

    def __enter__(self) -> GgufFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_gguf(path: Path) -> GgufFile:
    """``path`` mapped read-only and parsed (close it, or use it as a context manager).
    GgufError, naming the file, for one this reader refuses; OSError for one it cannot
    open."""
    with path.open("rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return GgufFile.parse(mapped)
    except GgufError as exc:
        mapped.close()
        raise GgufError(f"{path}: {exc}") from None
