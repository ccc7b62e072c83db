"""The decoder's shapes and options, read from a Hugging Face ``config.json``.

The shapes are a decoder's whatever its architecture (layers, hidden size, GQA
heads, vocabulary); the architecture (config.json's ``architectures``) picks a
spec from ``registry``, which says which options it implements (q/k-norm, rope
scaling, activations). A config of an architecture the engine does not serve,
or asking for an option its spec does not implement, is refused at start-up
rather than served wrong. With no file, the default is Qwen3-0.6B's shapes,
which match the bundled tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpu_frontend.errors import StartupError
from dpu_frontend.model import registry
from dpu_frontend.model.models.base import Llama3Scaling, MoeShape, moe_shape, rope_settings

#: Qwen3-0.6B's config.json, the fields this engine reads.
QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

_DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder's shapes and its architecture's options. Built by ``from_dict``/``load``,
    validated there."""

    #: config.json's ``architectures[0]``: its key in ``registry.MODELS``.
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    #: The checkpoint's dtype; the engine may run in another (``--dtype``).
    dtype: str
    eos_token_ids: tuple[int, ...]
    #: A per-head RMSNorm of q and k before RoPE (the architecture's: Qwen3).
    qk_norm: bool
    #: Llama 3.1's RoPE scaling, where the config asks for it (and the spec has it).
    rope_scaling: Llama3Scaling | None = None
    #: The experts of a mixture-of-experts MLP (Qwen3-MoE's); None for a dense one.
    moe: MoeShape | None = None

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, element_bytes: int, scale_bytes: int = 0) -> int:
        """K and V of one token over every layer; ``scale_bytes``: what each head's scale
        takes beside its values (an FP8 cache's float32: 4)."""
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * element_bytes
                                                          + scale_bytes)

    def parameter_count(self) -> int:
        """The weights' elements: the tensors of the architecture's table."""
        return registry.spec(self.architecture).weights.parameter_count(self)

    def linear_weights(self) -> tuple[int, int]:
        """The decoder layers' linear weights, every layer: (elements, output channels),
        what ``--quantization fp8`` keeps in FP8 with a scale per channel."""
        shapes = registry.spec(self.architecture).weights.linear_shapes(self)
        return (self.num_layers * sum(n * k for n, k in shapes),
                self.num_layers * sum(n for n, _ in shapes))

    @classmethod
    def default(cls) -> ModelConfig:
        return cls.from_dict(QWEN3_0_6B, "the built-in Qwen3-0.6B shapes")

    @classmethod
    def load(cls, path: Path) -> ModelConfig:
        """``path`` is a config.json or a checkpoint directory holding one."""
        file = path / "config.json" if path.is_dir() else path
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise StartupError(f"cannot read model config {file}: {exc}") from exc
        if not isinstance(data, dict):
            raise StartupError(f"{file}: a model config is a JSON object")
        return cls.from_dict(data, str(file))

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str) -> ModelConfig:
        try:
            return cls._parse(data)
        except (KeyError, TypeError, ValueError) as exc:
            what = f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)
            raise StartupError(f"{origin}: {what}") from exc

    @classmethod
    def _parse(cls, d: dict[str, Any]) -> ModelConfig:
        architecture = _architecture(d)
        spec = registry.spec(architecture)
        spec.check(d)
        heads, kv_heads = _positive(d, "num_attention_heads"), _positive(d, "num_key_value_heads")
        hidden = _positive(d, "hidden_size")
        head_dim = _positive(d, "head_dim") if "head_dim" in d else hidden // heads
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv_heads}")
        if head_dim not in (64, 128, 256):
            raise ValueError(f"head_dim {head_dim}: the attention kernel takes 64, 128 or 256")
        dtype = d.get("torch_dtype", d.get("dtype", "bfloat16"))
        if dtype not in _DTYPES:
            raise ValueError(f"torch_dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
        rope = rope_settings(d)
        eps, theta = float(d.get("rms_norm_eps", 1e-6)), rope.theta
        if not 0 < eps < 1 or not theta > 1:
            raise ValueError(f"rms_norm_eps {eps} or rope_theta {theta} out of range")
        vocab = _positive(d, "vocab_size")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in eos_ids):
            raise ValueError(f"eos_token_id {eos!r} is outside the vocabulary")
        return cls(
            architecture=architecture, vocab_size=vocab, hidden_size=hidden,
            intermediate_size=_positive(d, "intermediate_size"),
            num_layers=_positive(d, "num_hidden_layers"), num_heads=heads,
            num_kv_heads=kv_heads, head_dim=head_dim,
            max_position=_positive(d, "max_position_embeddings"), rms_norm_eps=eps,
            rope_theta=theta, tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            dtype=dtype, eos_token_ids=eos_ids, qk_norm=spec.qk_norm, rope_scaling=rope.llama3,
            moe=moe_shape(d) if spec.weights.moe else None,
        )


def _architecture(d: dict[str, Any]) -> str:
    """``architectures[0]``; a config without the list is taken by its ``model_type``."""
    names = d.get("architectures")
    if names is None:
        found = registry.by_model_type(d.get("model_type"))
        if found is None:
            raise ValueError(f"no architectures, and model_type {d.get('model_type')!r} is not "
                             f"served; this engine runs {', '.join(sorted(registry.MODELS))}")
        return found
    if not isinstance(names, list) or len(names) != 1 or not isinstance(names[0], str):
        raise ValueError(f"architectures must name one architecture, got {names!r}")
    return names[0]


def _positive(d: dict[str, Any], key: str) -> int:
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value
