"""Weights from a Hugging Face checkpoint directory, in safetensors.

A checkpoint is ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. Each file is an 8-byte little-endian header
length, a JSON header (name -> dtype, shape, byte range) and the raw tensors.
This module parses and checks the headers against the model's weight table
(``models.base.WeightTable``: HF's tensor names and shapes for the config's
architecture), memory-maps the files and hands out each tensor's bytes;
turning bytes into device tensors is the runner's job. Nothing here needs a
GPU, so the checks run in CI.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dpu_frontend.errors import StartupError
from dpu_frontend.model import registry
from dpu_frontend.model.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: A header larger than this is not a checkpoint (the format's own limit is 100 MB).
MAX_HEADER_BYTES = 100 << 20
#: safetensors dtype -> element size.
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4}
#: Buffers some exporters write that the model recomputes.
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


@dataclass(frozen=True, slots=True)
class TensorRef:
    """Where one tensor's bytes are: a file and a byte range past its header."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF's tensor names and shapes for ``config`` (its architecture's weight table)."""
    return registry.spec(config.architecture).weights.shapes(config)


def check_tensors(origin: str, found: dict[str, tuple[int, ...]], config: ModelConfig) -> None:
    """StartupError unless the tensors ``found`` (HF's names -> shapes) are the ones
    ``config``'s weight table has, in its shapes: none missing, none unknown (bar the
    buffers exporters add and a tied head written anyway)."""
    shapes = expected_shapes(config)
    tied_head = config.tie_word_embeddings and "lm_head.weight" in found
    unknown = sorted(n for n in found if n not in shapes and not _IGNORED.fullmatch(n)
                     and not (tied_head and n == "lm_head.weight"))
    if unknown:
        raise StartupError(f"{origin}: tensors this {config.architecture} config does not have: "
                           f"{', '.join(unknown[:5])}{' ...' if len(unknown) > 5 else ''}")
    missing = sorted(n for n in shapes if n not in found)
    if missing:
        raise StartupError(f"{origin}: missing tensors: {', '.join(missing[:5])}"
                           f"{' ...' if len(missing) > 5 else ''}")
    for name, shape in shapes.items():
        if found[name] != shape:
            raise StartupError(f"{origin}: {name} has shape {list(found[name])}, "
                               f"the config says {list(shape)}")


class Checkpoint:
    """The checked tensors of a checkpoint directory. ``open()`` maps the files."""

    def __init__(self, directory: Path, tensors: dict[str, TensorRef]) -> None:
        self.directory = directory
        self.tensors = tensors
        self._maps: dict[Path, mmap.mmap] = {}

    @classmethod
    def scan(cls, directory: Path, config: ModelConfig) -> Checkpoint:
        """Read every header and check names, dtypes, shapes and byte ranges."""
        found: dict[str, TensorRef] = {}
        for file in _files(directory):
            for ref in read_header(file):
                if ref.name in found:
                    raise StartupError(f"{directory}: tensor {ref.name} is in two files")
                found[ref.name] = ref
        check_tensors(str(directory), {n: ref.shape for n, ref in found.items()}, config)
        return cls(directory, {name: found[name] for name in expected_shapes(config)})

    def open(self) -> None:
        for ref in self.tensors.values():
            if ref.file not in self._maps:
                with ref.file.open("rb") as f:
                    self._maps[ref.file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def close(self) -> None:
        for m in self._maps.values():
            m.close()
        self._maps.clear()

    def __enter__(self) -> Checkpoint:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def data(self, name: str) -> memoryview:
        """The raw little-endian bytes of ``name`` (valid until ``close``)."""
        ref = self.tensors[name]
        return memoryview(self._maps[ref.file])[ref.start:ref.start + ref.nbytes]

    def __iter__(self) -> Iterator[TensorRef]:
        return iter(self.tensors.values())


def _files(directory: Path) -> list[Path]:
    index = directory / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise StartupError(f"cannot read {index}: {exc}") from exc
        files = []
        for name in names:
            if not isinstance(name, str) or Path(name).name != name:
                raise StartupError(f"{index}: shard {name!r} is not a file name in {directory}")
            files.append(directory / name)
        return files
    if (directory / SINGLE_FILE).exists():
        return [directory / SINGLE_FILE]
    raise StartupError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE}")


def read_header(file: Path) -> list[TensorRef]:
    """Parse and check one safetensors file's header."""
    try:
        with file.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(0)
            head = f.read(8)
            if len(head) < 8:
                raise StartupError(f"{file}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER_BYTES, size - 8):
                raise StartupError(f"{file}: header length {length} does not fit the file")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise StartupError(f"cannot read {file}: {exc}") from exc
    except ValueError as exc:
        raise StartupError(f"{file}: the header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise StartupError(f"{file}: the header is not a JSON object")
    base = 8 + length
    refs = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        refs.append(_entry(file, name, entry, base, size))
    spans = sorted((r.start, r.start + r.nbytes, r.name) for r in refs)
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise StartupError(f"{file}: tensors {a} and {b} overlap")
    return refs


def _entry(file: Path, name: str, entry: object, base: int, size: int) -> TensorRef:
    malformed = StartupError(f"{file}: malformed header entry for {name}")
    if not isinstance(entry, dict):
        raise malformed
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not isinstance(offsets, list) or len(offsets) != 2:
        raise malformed
    if not all(type(x) is int and x >= 0 for x in (*shape, *offsets)):
        raise malformed
    begin, end = offsets
    if dtype not in DTYPE_BYTES:
        raise StartupError(f"{file}: {name} is {dtype}; weights must be BF16, F16 or F32")
    nbytes = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - begin != nbytes or base + end > size:
        raise StartupError(f"{file}: {name} byte range [{begin}, {end}) does not hold "
                           f"{dtype} {list(shape)} inside the file")
    return TensorRef(name, file, dtype, tuple(shape), base + begin, nbytes)


def write(file: Path, tensors: dict[str, tuple[str, tuple[int, ...], bytes]]) -> None:
    """Write a safetensors file: name -> (dtype, shape, little-endian bytes).

    The tests use it to build small checkpoints in HF's naming.
    """
    header: dict[str, object] = {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as HF's writer does
    with file.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _, _, data in tensors.values():
            f.write(data)
