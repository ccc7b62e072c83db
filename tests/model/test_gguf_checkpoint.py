"""A llama GGUF file read as an HF checkpoint (``dpu_frontend.model.gguf_checkpoint``):
files written as llama.cpp's converter writes them (its names, its reversed dimensions,
its permutation of q and k), read back into the HF tensors they came from, and the
config as transformers' GGUF reader maps it."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from dpu_frontend.errors import StartupError
from dpu_frontend.gguf import GgufError, open_gguf
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.gguf_checkpoint import (
    GgufCheckpoint,
    hf_config,
    hf_name,
    hf_names,
    hf_tensor,
    load_config,
    tensor,
    unpermute,
)

LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 128, 96, 2, 1, 64, 40
#: transformers' GGUF reader (untyped; importable without torch): the reference for the
#: config's keys and for the permutation's reversal.
TRANSFORMERS_GGUF: Any = importlib.import_module("transformers.modeling_gguf_pytorch_utils")


def converter_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (convert_hf_to_gguf.py), as it writes q and k."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_checkpoint(seed: int, tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def draw(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    state = {"model.embed_tokens.weight": draw(VOCAB, HIDDEN), "model.norm.weight": draw(HIDDEN)}
    if not tied:
        state["lm_head.weight"] = draw(VOCAB, HIDDEN)
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        state |= {p + "input_layernorm.weight": draw(HIDDEN),
                  p + "self_attn.q_proj.weight": draw(HEADS * HEAD_DIM, HIDDEN),
                  p + "self_attn.k_proj.weight": draw(KV_HEADS * HEAD_DIM, HIDDEN),
                  p + "self_attn.v_proj.weight": draw(KV_HEADS * HEAD_DIM, HIDDEN),
                  p + "self_attn.o_proj.weight": draw(HIDDEN, HEADS * HEAD_DIM),
                  p + "post_attention_layernorm.weight": draw(HIDDEN),
                  p + "mlp.gate_proj.weight": draw(INTER, HIDDEN),
                  p + "mlp.up_proj.weight": draw(INTER, HIDDEN),
                  p + "mlp.down_proj.weight": draw(HIDDEN, INTER)}
    return state


def gguf_name(hf: str) -> str:
    for ours, theirs in (("model.embed_tokens.weight", "token_embd.weight"),
                         ("model.norm.weight", "output_norm.weight"),
                         ("lm_head.weight", "output.weight")):
        if hf == ours:
            return theirs
    n, rest = hf.removeprefix("model.layers.").split(".", 1)
    short = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    return f"blk.{n}.{short[rest.removesuffix('.weight')]}.weight"


def write(path: Path, state: dict[str, np.ndarray], *, arch: str = "llama",
          extra: dict[str, np.ndarray] | None = None, skip: str = "") -> None:
    """As the converter writes a llama checkpoint: metadata, then the tensors renamed,
    q and k permuted, in F32."""
    w = gguf.GGUFWriter(path, arch)
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    if skip != "rms_eps":
        w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for name, array in state.items():
        if name.endswith("q_proj.weight"):
            array = converter_permute(array, HEADS)
        elif name.endswith("k_proj.weight"):
            array = converter_permute(array, KV_HEADS)
        w.add_tensor(gguf_name(name), array)
    for name, array in (extra or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tied", [False, True])
def test_the_tensors_come_back_as_hf_holds_them(tmp_path: Path, tied: bool) -> None:
    state = hf_checkpoint(7, tied)
    path = tmp_path / "llama.gguf"
    write(path, state)
    with open_gguf(path) as f:
        config = hf_config(f)
        names = hf_names(f)
        assert set(names) == set(state)
        processor = TRANSFORMERS_GGUF.LlamaTensorProcessor(config)
        for hf, name in names.items():
            got = hf_tensor(f, name, config)
            assert got.shape == state[hf].shape and np.array_equal(got, state[hf]), hf
            # transformers' own reversal of the permutation gives the same rows.
            theirs = processor.process(tensor(f, name), name).weights
            assert np.array_equal(got, theirs), hf
    assert config["tie_word_embeddings"] is tied


def test_the_config_is_the_one_transformers_maps(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    write(path, hf_checkpoint(3, tied=True))
    with open_gguf(path) as f:
        config = hf_config(f)
        mapping: dict[str, str] = TRANSFORMERS_GGUF.GGUF_CONFIG_MAPPING["llama"]
        want = {hf: f.metadata[f"llama.{key}"] for key, hf in mapping.items()
                if f"llama.{key}" in f.metadata}
    for key, value in want.items():
        assert config[key] == pytest.approx(value), key
    assert config | {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                     "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2} == config
    assert config["num_key_value_heads"] == KV_HEADS and config["head_dim"] == HEAD_DIM


@pytest.mark.parametrize(("change", "message"), [
    ({"arch": "gpt2"}, "general.architecture 'gpt2': this engine reads llama GGUF files"),
    ({"skip": "rms_eps"}, "metadata llama.attention.layer_norm_rms_epsilon is missing"),
    ({"extra": {"rope_freqs.weight": np.ones(8, dtype=np.float32)}},
     "the file scales RoPE"),
])
def test_a_file_the_engine_cannot_serve_is_refused(tmp_path: Path, change: dict[str, Any],
                                                   message: str) -> None:
    path = tmp_path / "llama.gguf"
    write(path, hf_checkpoint(5, tied=True), **change)
    with open_gguf(path) as f, pytest.raises(GgufError, match=message):
        hf_config(f)


def test_names_and_the_permutation() -> None:
    assert hf_name("blk.12.ffn_down.weight") == "model.layers.12.mlp.down_proj.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    for bad in ("blk.0.attn_qkv.weight", "blk.x.attn_q.weight", "rope_freqs.weight"):
        with pytest.raises(GgufError, match="no counterpart in a llama checkpoint"):
            hf_name(bad)
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    assert np.array_equal(unpermute(converter_permute(w, 4), 4), w)
    # Head 0's rows 0..7 were written as the pairs (0, 4), (1, 5), (2, 6), (3, 7).
    assert list(converter_permute(w, 4)[:8, 0] // 3) == [0, 4, 1, 5, 2, 6, 3, 7]
    with pytest.raises(GgufError, match="30 rows in 4 heads of pairs"):
        unpermute(np.zeros((30, 3), dtype=np.float32), 4)


@pytest.mark.parametrize("tied", [False, True])
def test_the_model_peer_reads_the_file_as_a_checkpoint(tmp_path: Path, tied: bool) -> None:
    """``--weights FILE.gguf``: the config from its header, the tensors checked against the
    Llama weight table and handed to ``Params.load`` as float32 bytes in HF's layout."""
    state = hf_checkpoint(11, tied)
    path = tmp_path / "llama.gguf"
    write(path, state)
    config = load_config(path)
    assert (config.architecture, config.qk_norm, config.tie_word_embeddings) == (
        "LlamaForCausalLM", False, tied)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.vocab_size, config.eos_token_ids) == (
                LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, (2,))
    checkpoint = GgufCheckpoint.scan(path, config)
    assert set(checkpoint.tensors) == set(state) - ({"lm_head.weight"} if tied else set())
    with checkpoint:
        for name, ref in checkpoint.tensors.items():
            assert ref.dtype == "F32" and ref.shape == state[name].shape
            got = np.frombuffer(checkpoint.data(name), dtype=np.float32).reshape(ref.shape)
            assert np.array_equal(got, state[name]), name


def test_a_file_that_is_not_the_configs_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    write(path, hf_checkpoint(13, tied=True))
    other = ModelConfig.from_dict(hf_config_dict(intermediate_size=INTER * 2), "test")
    with pytest.raises(StartupError, match=r"mlp\.gate_proj\.weight has shape"):
        GgufCheckpoint.scan(path, other)
    (tmp_path / "bad.gguf").write_bytes(b"GGUF\x01\x00\x00\x00")
    with pytest.raises(StartupError, match=r"cannot read .*bad\.gguf: .*GGUF version 1"):
        load_config(tmp_path / "bad.gguf")


def hf_config_dict(**change: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "max_position_embeddings": 2048, "vocab_size": VOCAB,
            "tie_word_embeddings": True} | change
