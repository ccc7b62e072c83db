"""The architectures the engine serves: config.json's ``architectures`` string ->
the model's spec. One line a model; its decoder lives in ``models/``.

The specs need no torch (CI validates configs and checkpoints against them); the
decoder classes do, so ``decoder_class`` imports a model's module only when a
runner builds it on the GPU machine.
"""

from __future__ import annotations

import importlib
from typing import cast

from dpu_frontend.model.models.base import DecoderClass, ModelSpec, decoder_weights

MODELS: dict[str, ModelSpec] = {
    "Qwen3ForCausalLM": ModelSpec("qwen3", "qwen3:Qwen3", decoder_weights(qk_norm=True)),
    # Llama 2, 3 and 3.1 (its llama3 RoPE scaling), SmolLM2, and the Mistral-style
    # configs that need nothing more.
    "LlamaForCausalLM": ModelSpec("llama", "llama:Llama", decoder_weights(qk_norm=False),
                                  rope_scaling=("llama3",)),
    # Phi-4 (and Phi-3 where a config needs no window, long RoPE or partial rotation): the
    # Llama decoder over fused qkv_proj and gate_up_proj tensors.
    "Phi3ForCausalLM": ModelSpec("phi3", "llama:Llama",
                                 decoder_weights(qk_norm=False, fused=True)),
    # Qwen3-30B-A3B: Qwen3's attention, every layer's MLP a mixture of experts.
    "Qwen3MoeForCausalLM": ModelSpec("qwen3_moe", "qwen3_moe:Qwen3Moe",
                                     decoder_weights(qk_norm=True, moe=True)),
}


def spec(architecture: str) -> ModelSpec:
    """The spec of ``architecture``; ValueError naming the served ones if it is not."""
    found = MODELS.get(architecture)
    if found is None:
        raise ValueError(f"architecture {architecture!r} is not served; this engine runs "
                         f"{', '.join(sorted(MODELS))}")
    return found


def by_model_type(model_type: object) -> str | None:
    """The architecture of a config that names only its ``model_type``."""
    return next((name for name, s in MODELS.items() if s.model_type == model_type), None)


def decoder_class(architecture: str) -> DecoderClass:
    """The decoder class of ``architecture`` (imports its module: torch, Triton)."""
    module, _, name = spec(architecture).implementation.partition(":")
    loaded = importlib.import_module(f"dpu_frontend.model.models.{module}")
    return cast(DecoderClass, getattr(loaded, name))
