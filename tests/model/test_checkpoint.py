"""The safetensors checkpoint reader: HF's Qwen3 names, shapes, byte ranges."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from dpu_frontend.errors import StartupError
from dpu_frontend.model import checkpoint
from dpu_frontend.model.checkpoint import Checkpoint, expected_shapes
from dpu_frontend.model.config import QWEN3_0_6B, ModelConfig

TINY = ModelConfig.from_dict(QWEN3_0_6B | {
    "vocab_size": 50, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "eos_token_id": 1,
}, "tiny")

Tensors = dict[str, tuple[str, tuple[int, ...], bytes]]


def bf16(values: np.ndarray) -> bytes:
    """float32 -> bfloat16 bytes (round to nearest even), little-endian."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.astype("<u2").tobytes()


def from_bf16(data: memoryview) -> np.ndarray:
    return (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)


def tensors(config: ModelConfig, seed: int = 0) -> Tensors:
    rng = np.random.default_rng(seed)
    return {name: ("BF16", shape, bf16(rng.standard_normal(shape).astype(np.float32)))
            for name, shape in expected_shapes(config).items()}


def test_a_checkpoint_in_hf_naming_loads(tmp_path: Path) -> None:
    data = tensors(TINY)
    checkpoint.write(tmp_path / "model.safetensors", data)
    with Checkpoint.scan(tmp_path, TINY) as ckpt:
        assert set(ckpt.tensors) == set(data)
        for name, (_, shape, raw) in data.items():
            assert ckpt.tensors[name].shape == shape
            assert bytes(ckpt.data(name)) == raw
        values = from_bf16(ckpt.data("model.norm.weight"))
        assert values.shape == (16,) and np.all(np.isfinite(values))


TINY_PHI3 = ModelConfig.from_dict({
    "architectures": ["Phi3ForCausalLM"], "vocab_size": 50, "hidden_size": 16,
    "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 256,
    "eos_token_id": 1,
}, "tiny phi3")


def test_a_phi3_checkpoint_has_fused_projections(tmp_path: Path) -> None:
    """Phi-3's qkv_proj and gate_up_proj, one tensor each, are the engine's packed
    parameters as they are; Llama's separate names do not stand in for them."""
    data = tensors(TINY_PHI3)
    assert data["model.layers.1.self_attn.qkv_proj.weight"][1] == (64 * 2 + 64 * 2, 16)
    assert data["model.layers.1.mlp.gate_up_proj.weight"][1] == (64, 16)
    checkpoint.write(tmp_path / "model.safetensors", data)
    with Checkpoint.scan(tmp_path, TINY_PHI3) as ckpt:
        assert set(ckpt.tensors) == set(data)
    other = tmp_path / "llama-named"
    other.mkdir()
    checkpoint.write(other / "model.safetensors", tensors(TINY))
    with pytest.raises(StartupError, match="tensors this Phi3ForCausalLM config does not have"):
        Checkpoint.scan(other, TINY_PHI3)


TINY_MOE = ModelConfig.from_dict(QWEN3_0_6B | {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 50,
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "eos_token_id": 1,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8,
}, "tiny moe")


def test_a_moe_checkpoint_has_a_tensor_per_expert(tmp_path: Path) -> None:
    """Qwen3-MoE's checkpoint: a router and each expert's three projections, by name;
    a missing expert is named."""
    data = tensors(TINY_MOE)
    assert data["model.layers.1.mlp.gate.weight"][1] == (4, 16)
    assert data["model.layers.1.mlp.experts.3.up_proj.weight"][1] == (8, 16)
    assert data["model.layers.1.mlp.experts.3.down_proj.weight"][1] == (16, 8)
    assert len([n for n in data if ".mlp.experts." in n]) == 2 * 4 * 3
    assert "model.layers.0.mlp.gate_proj.weight" not in data
    checkpoint.write(tmp_path / "model.safetensors", data)
    with Checkpoint.scan(tmp_path, TINY_MOE) as ckpt:
        assert set(ckpt.tensors) == set(data)
    other = tmp_path / "one-expert-short"
    other.mkdir()
    del data["model.layers.0.mlp.experts.2.gate_proj.weight"]
    checkpoint.write(other / "model.safetensors", data)
    with pytest.raises(StartupError, match=r"model\.layers\.0\.mlp\.experts\.2\.gate_proj"):
        Checkpoint.scan(other, TINY_MOE)


def test_sharded_checkpoint_with_index(tmp_path: Path) -> None:
    data = tensors(TINY)
    names = sorted(data)
    shards = {"model-00001-of-00002.safetensors": names[:10],
              "model-00002-of-00002.safetensors": names[10:]}
    weight_map: dict[str, str] = {}
    for file, part in shards.items():
        checkpoint.write(tmp_path / file, {n: data[n] for n in part})
        weight_map |= dict.fromkeys(part, file)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with Checkpoint.scan(tmp_path, TINY) as ckpt:
        assert {r.file.name for r in ckpt} == set(shards)
        assert bytes(ckpt.data(names[-1])) == data[names[-1]][2]


def test_tied_head_present_is_ignored_untied_head_required(tmp_path: Path) -> None:
    data = tensors(TINY)
    data["lm_head.weight"] = data["model.embed_tokens.weight"]
    data["model.layers.0.self_attn.rotary_emb.inv_freq"] = ("F32", (32,), bytes(128))
    checkpoint.write(tmp_path / "model.safetensors", data)
    assert "lm_head.weight" not in Checkpoint.scan(tmp_path, TINY).tensors
    untied = ModelConfig.from_dict(QWEN3_0_6B | {
        "vocab_size": 50, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "eos_token_id": 1,
        "tie_word_embeddings": False}, "untied")
    assert "lm_head.weight" in Checkpoint.scan(tmp_path, untied).tensors
    del data["lm_head.weight"]
    checkpoint.write(tmp_path / "model.safetensors", data)
    with pytest.raises(StartupError, match=re.escape("missing tensors: lm_head.weight")):
        Checkpoint.scan(tmp_path, untied)


def test_wrong_shape_unknown_and_missing_tensors(tmp_path: Path) -> None:
    data = tensors(TINY)
    data["model.norm.weight"] = ("BF16", (8,), bytes(16))
    checkpoint.write(tmp_path / "model.safetensors", data)
    with pytest.raises(StartupError, match=r"model.norm.weight has shape \[8\], the config says \[16\]"):
        Checkpoint.scan(tmp_path, TINY)
    data = tensors(TINY) | {"model.layers.0.mlp.experts.0.weight": ("BF16", (2,), bytes(4))}
    checkpoint.write(tmp_path / "model.safetensors", data)
    with pytest.raises(StartupError, match=re.escape("does not have: model.layers.0.mlp.experts.0.weight")):
        Checkpoint.scan(tmp_path, TINY)
    data = tensors(TINY)
    del data["model.layers.1.self_attn.k_norm.weight"]
    checkpoint.write(tmp_path / "model.safetensors", data)
    missing = re.escape("missing tensors: model.layers.1.self_attn.k_norm.weight")
    with pytest.raises(StartupError, match=missing):
        Checkpoint.scan(tmp_path, TINY)


def raw_file(path: Path, header: dict[str, object], payload: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)


@pytest.mark.parametrize(("header", "payload", "message"), [
    ({"a": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]}}, bytes(2), "must be BF16, F16 or F32"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(8), "does not hold F32"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8), "inside the file"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12), "overlap"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), "malformed"),
    ({"a": {"dtype": "F32", "shape": [1]}}, bytes(4), "malformed"),
    ({"a": [1, 2]}, b"", "malformed"),
])
def test_bad_headers_are_refused(tmp_path: Path, header: dict[str, object], payload: bytes,
                                 message: str) -> None:
    raw_file(tmp_path / "model.safetensors", header, payload)
    with pytest.raises(StartupError, match=message):
        Checkpoint.scan(tmp_path, TINY)


def test_truncated_and_absent_files(tmp_path: Path) -> None:
    with pytest.raises(StartupError, match=re.escape("neither model.safetensors")):
        Checkpoint.scan(tmp_path, TINY)
    (tmp_path / "model.safetensors").write_bytes(b"\x00\x01")
    with pytest.raises(StartupError, match="too short"):
        Checkpoint.scan(tmp_path, TINY)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(StartupError, match="does not fit the file"):
        Checkpoint.scan(tmp_path, TINY)
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{x")
    with pytest.raises(StartupError, match="not JSON"):
        Checkpoint.scan(tmp_path, TINY)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../x"}}))
    with pytest.raises(StartupError, match="is not a file name"):
        Checkpoint.scan(tmp_path, TINY)


#: Qwen3's tensors of one layer, as HF names them (the table must declare exactly these).
QWEN3_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
               "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_the_qwen3_table_names_hf_tensors() -> None:
    h, d, i, q, kv = 16, 64, 32, 128, 64
    want = {"model.embed_tokens.weight": (50, h), "model.norm.weight": (h,)}
    for n in range(2):
        shapes = dict(zip(QWEN3_LAYER, [(h,), (h,), (q, h), (kv, h), (kv, h), (h, q), (d,), (d,),
                                        (i, h), (i, h), (h, i)], strict=True))
        want |= {f"model.layers.{n}.{name}.weight": shape for name, shape in shapes.items()}
    assert expected_shapes(TINY) == want
    assert TINY.parameter_count() == sum(int(np.prod(s)) for s in want.values())
