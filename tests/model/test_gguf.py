"""The GGUF reader (``dpu_frontend.gguf``) and its dequantizers
(``gguf_checkpoint``) against files written by llama.cpp's own Python package (PyPI
``gguf``): the metadata and tensors read, the dequantizers bit for bit the package's,
and every malformed header refused with the reason."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from dpu_frontend.gguf import DEFAULT_ALIGNMENT, GgufError, GgufFile, TensorType, open_gguf
from dpu_frontend.model.gguf_checkpoint import dequantize, tensor

Q = gguf.GGMLQuantizationType
#: Each type, with ggml's own numbering beside ours.
TYPES = [(Q.F32, TensorType.F32), (Q.F16, TensorType.F16), (Q.BF16, TensorType.BF16),
         (Q.Q8_0, TensorType.Q8_0), (Q.Q4_0, TensorType.Q4_0), (Q.Q4_1, TensorType.Q4_1)]


def write(path: Path, tensors: dict[str, tuple[np.ndarray, gguf.GGMLQuantizationType]],
          metadata: bool = True) -> None:
    """A GGUF file as llama.cpp's converter writes one: llama metadata, then the tensors
    quantized by the package's own quantizers."""
    w = gguf.GGUFWriter(path, "llama")
    if metadata:
        w.add_block_count(2)
        w.add_embedding_length(64)
        w.add_head_count(4)
        w.add_rope_freq_base(1e5)
        w.add_string("tokenizer.chat_template", "{{ messages }} ✓")
        w.add_array("tokenizer.ggml.tokens", ["<|im_start|>", "Ġthe", "日本"])
        w.add_array("tokenizer.ggml.token_type", [3, 1, 1])
        w.add_bool("general.flag", True)
    for name, (array, qtype) in tensors.items():
        data = gguf.quants.quantize(array, qtype)
        w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def sample(shape: tuple[int, ...], seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32) * 0.05
    x.flat[::37] = 0.0  # whole zero stretches, and signed zeros, in some blocks
    x.flat[5] = -0.0
    return x


def test_metadata_and_every_type_read_as_llama_cpp_writes_them(tmp_path: Path) -> None:
    tensors = {f"blk.{i}.{qtype.name}": (sample((48, 96), i), qtype)
               for i, (qtype, _) in enumerate(TYPES)}
    tensors["token_embd.weight"] = (sample((5, 64), 9), Q.Q8_0)
    tensors["output_norm.weight"] = (sample((64,), 10), Q.F32)
    path = tmp_path / "m.gguf"
    write(path, tensors)
    with open_gguf(path) as f:
        assert f.version == 3 and f.alignment == DEFAULT_ALIGNMENT
        m = f.metadata
        assert m["general.architecture"] == "llama"
        assert (m["llama.block_count"], m["llama.embedding_length"]) == (2, 64)
        assert m["llama.rope.freq_base"] == pytest.approx(1e5)
        assert m["tokenizer.chat_template"] == "{{ messages }} ✓"
        assert m["tokenizer.ggml.tokens"] == ["<|im_start|>", "Ġthe", "日本"]
        assert m["tokenizer.ggml.token_type"] == [3, 1, 1] and m["general.flag"] is True
        assert set(f.tensors) == set(tensors)
        for i, (qtype, ours) in enumerate(TYPES):
            name = f"blk.{i}.{qtype.name}"
            info = f.tensors[name]
            assert info.type == ours and info.shape == (48, 96) and info.dims == (96, 48)
            stored = gguf.quants.quantize(tensors[name][0], qtype)
            want = gguf.quants.dequantize(stored, qtype).reshape(48, 96).astype(np.float32)
            got = tensor(f, name)
            assert got.dtype == np.float32 and got.shape == (48, 96)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), qtype.name
            # Quantization moved the values by no more than its step.
            assert np.abs(got - tensors[name][0]).max() < 0.02, qtype.name
        assert f.tensors["output_norm.weight"].shape == (64,)
        assert np.array_equal(tensor(f, "output_norm.weight"), tensors["output_norm.weight"][0])


def test_dequantize_reads_the_block_layouts() -> None:
    """One block of each format by hand: d (and m) as float16, then the values."""
    d, m = np.float16(0.5).tobytes(), np.float16(-1.0).tobytes()
    q8 = d + np.arange(-16, 16, dtype=np.int8).tobytes()
    assert np.array_equal(dequantize(q8, TensorType.Q8_0), np.arange(-16, 16) * 0.5)
    nibbles = bytes((lo | (hi << 4)) for lo, hi in zip(range(16), range(15, -1, -1), strict=True))
    q4 = np.concatenate([np.arange(16), np.arange(15, -1, -1)]).astype(np.float32)
    assert np.array_equal(dequantize(d + nibbles, TensorType.Q4_0), (q4 - 8) * 0.5)
    assert np.array_equal(dequantize(d + m + nibbles, TensorType.Q4_1), q4 * 0.5 - 1.0)
    bf16 = np.array([1.5, -2.0, 3.0e38], dtype=np.float32).view(np.uint32) >> 16
    assert np.array_equal(dequantize(bf16.astype("<u2").tobytes(), TensorType.BF16),
                          np.array([1.5, -2.0, 3.0e38], dtype=np.float32).view(np.uint32)
                          .__and__(0xFFFF0000).view(np.float32))


def header(*, magic: bytes = b"GGUF", version: int = 3, kv: list[bytes] | None = None,
           tensors: list[tuple[str, list[int], int, int]] | None = None,
           n_tensors: int | None = None, data: int = 0, pad_to: int = 32) -> bytes:
    """A GGUF file by hand, for the malformed cases: ``tensors`` as (name, dims, ggml
    type, offset); ``data`` bytes of zeros after the aligned data start."""
    kv = kv or []
    tensors = tensors or []

    def string(s: str) -> bytes:
        raw = s.encode()
        return struct.pack("<Q", len(raw)) + raw

    out = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                              len(kv))
    out += b"".join(kv)
    for name, dims, kind, offset in tensors:
        out += string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, kind, offset)
    out += bytes(-len(out) % pad_to)
    return out + bytes(data)


def kv_u32(key: str, value: int) -> bytes:
    raw = key.encode()
    return struct.pack("<Q", len(raw)) + raw + struct.pack("<II", 4, value)


GOOD = [("w", [32, 2], 8, 0)]  # one Q8_0 tensor of 2 blocks: 68 bytes


@pytest.mark.parametrize(("data", "message"), [
    (b"", "the magic at byte 0: 4 bytes past the end"),
    (header(magic=b"GGML"), "not a GGUF file"),
    (header(version=1), "GGUF version 1; this reader takes 2, 3"),
    (header(n_tensors=2**40), "a corrupt header"),
    (header(kv=[struct.pack("<Q", 2**40) + b"k"]), "a string of 1099511627776 bytes"),
    (header(kv=[kv_u32("a", 1) + b"", kv_u32("a", 2)]), "metadata key 'a' twice"),
    (header(kv=[struct.pack("<Q", 1) + b"k" + struct.pack("<I", 99)]), "unknown value type 99"),
    (header(kv=[struct.pack("<Q", 1) + b"k" + struct.pack("<IIQ", 9, 4, 2**30)]),
     "an array of 1073741824 elements"),
    (header(kv=[kv_u32("general.alignment", 24)], tensors=GOOD, data=68),
     "general.alignment 24 is not a power of two"),
    (header(tensors=GOOD, data=67), "past the end of the file"),
    (header(tensors=[("w", [32, 2], 12, 0)], data=68), "ggml type 12 is not one"),
    (header(tensors=[("w", [30, 2], 8, 0)], data=68), "rows of 30 elements in Q8_0 blocks of 32"),
    (header(tensors=[("w", [32, 0], 8, 0)], data=68), "dimensions [32, 0]"),
    (header(tensors=[("w", [32] * 5, 8, 0)], data=68), "5 dimensions"),
    (header(tensors=[("w", [32, 2], 8, 16)], data=96), "not a multiple of the alignment 32"),
    (header(tensors=[("a", [32, 2], 8, 0), ("b", [32], 8, 32)], data=96), "overlaps"),
    (header(tensors=[("a", [32], 8, 0), ("a", [32], 8, 64)], data=128), "tensor 'a' twice"),
])
def test_a_malformed_header_is_refused_with_the_reason(data: bytes, message: str) -> None:
    with pytest.raises(GgufError) as err:
        GgufFile.parse(data)
    assert message in str(err.value)


def test_a_hand_written_file_reads_and_a_path_names_itself_in_errors(tmp_path: Path) -> None:
    data = bytearray(header(tensors=GOOD, data=68))
    start = len(data) - 68
    data[start:start + 2] = np.float16(2.0).tobytes()
    data[start + 2:start + 34] = np.full(32, 3, dtype=np.int8).tobytes()
    f = GgufFile.parse(bytes(data))
    assert f.data_start == start and f.tensors["w"].shape == (2, 32)
    got = tensor(f, "w")
    assert np.array_equal(got[0], np.full(32, 6.0)) and np.array_equal(got[1], np.zeros(32))
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data[:-1]))
    with pytest.raises(GgufError, match=f"^{re.escape(str(bad))}: tensor 'w' ends at byte"):
        open_gguf(bad)
