"""The model config: HF config.json in, checked shapes out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dpu_frontend.errors import StartupError
from dpu_frontend.model import registry
from dpu_frontend.model.checkpoint import expected_shapes
from dpu_frontend.model.config import QWEN3_0_6B, ModelConfig
from dpu_frontend.model.models.base import Llama3Scaling, MoeShape


def test_default_is_qwen3_0_6b() -> None:
    c = ModelConfig.default()
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (28, 1024, 16, 8, 128)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta) == (3072, 151936, 1e6)
    assert c.group_size == 2 and c.tie_word_embeddings
    assert c.kv_bytes_per_token(2) == 112 * 1024  # the "about 112 KiB per token"
    assert 595e6 < c.parameter_count() < 597e6
    assert c.eos_token_ids == (151645,)


def test_load_file_and_directory(tmp_path: Path) -> None:
    data = QWEN3_0_6B | {"num_hidden_layers": 2, "eos_token_id": [151643, 151645]}
    (tmp_path / "config.json").write_text(json.dumps(data))
    for path in (tmp_path, tmp_path / "config.json"):
        c = ModelConfig.load(path)
        assert c.num_layers == 2 and c.eos_token_ids == (151643, 151645)


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    data = {k: v for k, v in QWEN3_0_6B.items() if k != "head_dim"} | {"hidden_size": 2048}
    assert ModelConfig.from_dict(data, "x").head_dim == 128


@pytest.mark.parametrize(("change", "message"), [
    ({"model_type": "llama"}, "model_type 'llama' does not match the architecture's"),
    ({"architectures": ["GPT2LMHeadModel"]}, "'GPT2LMHeadModel' is not served; this engine runs"),
    ({"architectures": "Qwen3ForCausalLM"}, "architectures must name one architecture"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"head_dim": 96}, "head_dim 96"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"hidden_size": True}, "hidden_size must be a positive integer"),
    ({"torch_dtype": "int8"}, "torch_dtype 'int8'"),
    ({"eos_token_id": 151936}, "outside the vocabulary"),
    ({"rms_norm_eps": 0}, "out of range"),
])
def test_refused_configs_say_why(change: dict[str, Any], message: str) -> None:
    with pytest.raises(StartupError, match=message):
        ModelConfig.from_dict(QWEN3_0_6B | change, "cfg")


#: Meta-Llama-3-8B's config.json (the fields the engine reads, as published).
LLAMA_3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "vocab_size": 128256, "tie_word_embeddings": False,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "rope_scaling": None,
    "torch_dtype": "bfloat16",
}


def test_a_llama_config_is_served_without_q_and_k_norms() -> None:
    c = ModelConfig.from_dict(LLAMA_3_8B, "llama-3-8b")
    assert (c.architecture, c.qk_norm, c.head_dim, c.group_size, c.rope_theta) == (
        "LlamaForCausalLM", False, 128, 4, 500000.0)
    assert c.parameter_count() == 8_030_261_248  # Meta's 8.03B
    # Mistral-7B v0.1's shapes without its window are a Llama config too.
    mistral = LLAMA_3_8B | {"vocab_size": 32000, "rope_theta": 10000.0, "bos_token_id": 1,
                            "eos_token_id": 2, "sliding_window": None}
    assert ModelConfig.from_dict(mistral, "mistral").num_kv_heads == 8


#: Meta-Llama-3.1-8B-Instruct's RoPE (its config.json as published).
LLAMA_31_ROPE: dict[str, Any] = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA_3_1_8B: dict[str, Any] = LLAMA_3_8B | {
    "max_position_embeddings": 131072, "rope_scaling": LLAMA_31_ROPE,
    "eos_token_id": [128001, 128008, 128009]}


def test_llama_3_1s_rope_scaling_is_read_from_either_layout() -> None:
    c = ModelConfig.from_dict(LLAMA_3_1_8B, "llama-3.1-8b")
    assert c.rope_scaling == Llama3Scaling(8.0, 1.0, 4.0, 8192)
    assert (c.rope_theta, c.max_position, c.eos_token_ids) == (
        500000.0, 131072, (128001, 128008, 128009))
    assert c.parameter_count() == 8_030_261_248
    # transformers 5's layout: the base inside rope_parameters.
    v5 = {k: v for k, v in LLAMA_3_1_8B.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = LLAMA_31_ROPE | {"rope_theta": 500000.0}
    assert ModelConfig.from_dict(v5, "cfg") == c
    assert ModelConfig.from_dict(LLAMA_3_8B, "cfg").rope_scaling is None
    # The pretraining length as transformers takes it: the config's own first, then the
    # entry's, then max_position_embeddings.
    own = LLAMA_3_1_8B | {"original_max_position_embeddings": 4096}
    assert ModelConfig.from_dict(own, "cfg").rope_scaling == Llama3Scaling(8.0, 1.0, 4.0, 4096)
    bare = LLAMA_3_1_8B | {"rope_scaling": {k: v for k, v in LLAMA_31_ROPE.items()
                                            if k != "original_max_position_embeddings"}}
    assert ModelConfig.from_dict(bare, "cfg").rope_scaling == Llama3Scaling(8.0, 1.0, 4.0,
                                                                            131072)


@pytest.mark.parametrize(("rope", "message"), [
    ({"rope_type": "llama3", "factor": 8.0}, "the llama3 scaling needs 'low_freq_factor'"),
    (LLAMA_31_ROPE | {"factor": 0.5}, "out of range"),
    (LLAMA_31_ROPE | {"low_freq_factor": 4.0}, "out of range"),
    (LLAMA_31_ROPE | {"original_max_position_embeddings": 0}, "out of range"),
])
def test_a_llama3_scaling_that_cannot_be_right_is_refused(rope: dict[str, Any],
                                                           message: str) -> None:
    with pytest.raises(StartupError, match=message):
        ModelConfig.from_dict(LLAMA_3_8B | {"rope_scaling": rope}, "cfg")


def test_only_llama_implements_the_llama3_scaling() -> None:
    with pytest.raises(StartupError, match=r"rope_scaling = .*llama3.* is not implemented"):
        ModelConfig.from_dict(QWEN3_0_6B | {"rope_scaling": LLAMA_31_ROPE}, "cfg")


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
    ({"sliding_window": 4096}, "sliding_window = 4096"),  # Mistral-7B v0.1's
    ({"mlp_bias": True}, "mlp_bias"),
    ({"model_type": "qwen3"}, "model_type 'qwen3' does not match"),
])
def test_a_llama_config_needing_what_is_not_built_is_refused(change: dict[str, Any],
                                                              message: str) -> None:
    with pytest.raises(StartupError, match=message):
        ModelConfig.from_dict(LLAMA_3_8B | change, "cfg")


#: microsoft/phi-4's config.json (the fields the engine reads, as published).
PHI_4: dict[str, Any] = {
    "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 5120,
    "intermediate_size": 17920, "num_hidden_layers": 40, "num_attention_heads": 40,
    "num_key_value_heads": 10, "max_position_embeddings": 16384,
    "original_max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 250000,
    "rope_scaling": None, "sliding_window": None, "vocab_size": 100352,
    "tie_word_embeddings": False, "bos_token_id": 100257, "eos_token_id": 100265,
    "pad_token_id": 100349, "hidden_act": "silu", "torch_dtype": "bfloat16",
}


def test_phi_4_is_served_with_its_fused_projections() -> None:
    c = ModelConfig.from_dict(PHI_4, "phi-4")
    assert (c.architecture, c.qk_norm, c.head_dim, c.group_size) == (
        "Phi3ForCausalLM", False, 128, 4)
    assert c.parameter_count() == 14_659_507_200  # Microsoft's 14.7B
    names = expected_shapes(c)
    assert names["model.layers.0.self_attn.qkv_proj.weight"] == (5120 + 2 * 1280, 5120)
    assert names["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 17920, 5120)
    assert "model.layers.0.self_attn.q_proj.weight" not in names


@pytest.mark.parametrize(("change", "message"), [
    ({"sliding_window": 2047}, "sliding_window = 2047"),  # Phi-3-mini-4k's
    ({"rope_scaling": {"type": "longrope", "long_factor": [1.0], "short_factor": [1.0]}},
     "rope_scaling"),  # Phi-3.5's and Phi-4-mini's
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),  # Phi-4-mini's
])
def test_a_phi3_config_needing_what_is_not_built_is_refused(change: dict[str, Any],
                                                            message: str) -> None:
    with pytest.raises(StartupError, match=message):
        ModelConfig.from_dict(PHI_4 | change, "cfg")


def test_transformers_5s_rope_parameters_are_read() -> None:
    """transformers 5 writes RoPE as ``rope_parameters`` and leaves ``rope_theta`` out:
    the base is read from there (not defaulted to 10,000), and its type refused as
    ``rope_scaling``'s is."""
    qwen = {k: v for k, v in QWEN3_0_6B.items() if k not in ("rope_theta", "rope_scaling")}
    written = qwen | {"rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}}
    assert ModelConfig.from_dict(written, "cfg").rope_theta == 1e6
    llama = {k: v for k, v in LLAMA_3_8B.items() if k not in ("rope_theta", "rope_scaling")}
    scaled = llama | {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "yarn",
                                          "factor": 4.0}}
    with pytest.raises(StartupError, match=r"rope_parameters = .*yarn.* is not implemented"):
        ModelConfig.from_dict(scaled, "cfg")
    partial = llama | {"rope_parameters": {"rope_theta": 1e4, "rope_type": "default",
                                           "partial_rotary_factor": 0.75}}
    with pytest.raises(StartupError, match=r"partial_rotary_factor = 0\.75"):
        ModelConfig.from_dict(partial, "cfg")
    with pytest.raises(StartupError, match="rope_parameters = 5 is not an object"):
        ModelConfig.from_dict(llama | {"rope_parameters": 5}, "cfg")
    # Without either, the base is HF's default.
    assert ModelConfig.from_dict(llama, "cfg").rope_theta == 10000.0


def test_missing_field_and_bad_file(tmp_path: Path) -> None:
    data = {k: v for k, v in QWEN3_0_6B.items() if k != "vocab_size"}
    with pytest.raises(StartupError, match="missing field 'vocab_size'"):
        ModelConfig.from_dict(data, "cfg")
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(StartupError, match="cannot read model config"):
        ModelConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(StartupError, match="a JSON object"):
        ModelConfig.load(tmp_path)


def test_a_config_without_architectures_is_taken_by_its_model_type() -> None:
    data = {k: v for k, v in QWEN3_0_6B.items() if k != "architectures"}
    config = ModelConfig.from_dict(data, "x")
    assert config.architecture == "Qwen3ForCausalLM" and config.qk_norm
    with pytest.raises(StartupError, match="no architectures, and model_type 'mystery'"):
        ModelConfig.from_dict(data | {"model_type": "mystery"}, "x")


def test_every_served_architecture_has_a_decoder_module() -> None:
    """Each registry line names a module of ``dpu_frontend/model/models`` and a class in
    it (read from the source: CI has no torch to import it with)."""
    models = Path(registry.__file__).parent / "models"
    for name, spec in registry.MODELS.items():
        module, _, cls = spec.implementation.partition(":")
        source = (models / f"{module}.py").read_text()
        assert f"class {cls}" in source, name


#: Qwen/Qwen3-30B-A3B's config.json (the fields the engine reads, as published).
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
    "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None,
    "sliding_window": None, "use_sliding_window": False, "attention_bias": False,
    "vocab_size": 151936, "tie_word_embeddings": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "torch_dtype": "bfloat16",
}


def test_qwen3_30b_a3b_is_served_with_its_experts() -> None:
    c = ModelConfig.from_dict(QWEN3_30B_A3B, "qwen3-30b-a3b")
    assert c.moe == MoeShape(num_experts=128, top_k=8, intermediate=768, norm_topk_prob=True)
    assert (c.architecture, c.qk_norm, c.group_size) == ("Qwen3MoeForCausalLM", True, 8)
    assert c.parameter_count() == 30_532_122_624  # Qwen's 30.5B
    names = expected_shapes(c)
    assert names["model.layers.47.mlp.gate.weight"] == (128, 2048)
    assert names["model.layers.0.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert names["model.layers.0.mlp.experts.0.down_proj.weight"] == (2048, 768)
    assert "model.layers.0.mlp.gate_proj.weight" not in names
    # One layer's linear weights: qkv, o, the router, every expert's gate_up and down.
    assert registry.spec(c.architecture).weights.linear_shapes(c) == [
        (4096 + 2 * 512, 2048), (2048, 4096), (128, 2048), (128 * 2 * 768, 2048),
        (128 * 2048, 768)]


@pytest.mark.parametrize(("change", "message"), [
    ({"decoder_sparse_step": 2}, "dense layers among the sparse ones"),
    ({"mlp_only_layers": [0]}, "dense layers among the sparse ones"),
    ({"shared_expert_intermediate_size": 5632}, "a shared expert"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok 129"),
    ({"num_experts_per_tok": 17, "num_experts": 64}, "num_experts_per_tok 17"),
    ({"num_experts": 1024}, "num_experts 1024"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size 0"),
])
def test_a_moe_config_needing_what_is_not_built_is_refused(change: dict[str, Any],
                                                            message: str) -> None:
    with pytest.raises(StartupError, match=message):
        ModelConfig.from_dict(QWEN3_30B_A3B | change, "cfg")
    with pytest.raises(StartupError, match="missing field 'num_experts'"):
        ModelConfig.from_dict({k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"},
                              "cfg")
