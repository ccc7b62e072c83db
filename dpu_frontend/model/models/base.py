"""What every model declares, and what the engine asks of it.

A model is a decoder over the paged KV cache (``Decoder``: ``forward`` and
``logits``) plus a ``ModelSpec``: the config.json it takes, the options it
implements, and its ``WeightTable``, which names each of its parameters, the
HF tensors packed into it and their shapes. The table, declared once, drives
the checkpoint's expected names and shapes (``checkpoint.py``), loading and
random weights (``weights.py``) and the state dict that the tests hand to
``transformers``. Nothing here needs torch: CI checks configs and checkpoints
against the tables.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

if TYPE_CHECKING:
    import torch

    from dpu_frontend.model.config import ModelConfig
    from dpu_frontend.model.layers.attention import Attention, KvCache
    from dpu_frontend.model.layers.collective import TensorGroup
    from dpu_frontend.model.weights import Params

Shape = Callable[["ModelConfig"], tuple[int, ...]]
#: How random weights are drawn: ``linear`` N(0, 0.02) as HF initializes them; ``norm``
#: N(1, 0.1), so that the norms' weights are exercised too.
INITS = ("linear", "norm")


#: How an HF tensor is cut over the ranks of tensor parallelism (``tensor_parallel``):
#: ``whole``: every rank holds all of it;
#: ``q_heads``: rows by query heads (``head_dim`` rows a head), q_proj's;
#: ``kv_heads``: rows by KV heads, k_proj's and v_proj's;
#: ``qkv``: a fused [q | k | v] tensor (Phi-3's qkv_proj): each block as above;
#: ``rows``: an even share of the rows (gate_proj, up_proj, an expert's);
#: ``gate_up``: a fused [gate | up] tensor (Phi-3's gate_up_proj): each half as ``rows``;
#: ``q_heads_in``: columns by query heads, o_proj's;
#: ``columns``: an even share of the columns (down_proj, an expert's);
#: ``vocab``: rows by vocabulary range, the LM head's.
Split = Literal["whole", "q_heads", "kv_heads", "qkv", "rows", "gate_up", "q_heads_in",
                "columns", "vocab"]
SPLITS: tuple[Split, ...] = get_args(Split)


@dataclass(frozen=True, slots=True)
class Part:
    """One HF tensor of a parameter: its name (past ``model.layers.{n}.`` for a layer's),
    its shape, and how tensor parallelism cuts it (``split``)."""

    hf: str
    shape: Shape
    split: Split = "whole"

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"tensor {self.hf}: split {self.split!r} is not one of {SPLITS}")


@dataclass(frozen=True, slots=True)
class Param:
    """A parameter of the decoder: its HF tensors stacked along dimension 0 in part
    order (q, k and v into one ``qkv``: one linear instead of three). ``experts``: the
    parts repeat for each of the config's experts, ``{e}`` in their names, expert by
    expert (a MoE layer's [experts x rows, K], viewed as [experts, rows, K])."""

    name: str
    parts: tuple[Part, ...]
    init: str = "linear"
    experts: bool = False

    def __post_init__(self) -> None:
        if not self.parts or self.init not in INITS:
            raise ValueError(f"parameter {self.name}: no parts, or init {self.init!r}")

    def parts_for(self, config: ModelConfig) -> tuple[Part, ...]:
        """The parts as a checkpoint holds them for ``config``: an expert parameter's
        once for each expert, in expert order."""
        if not self.experts:
            return self.parts
        if config.moe is None:
            raise ValueError(f"parameter {self.name} is an expert's, the config has no experts")
        return tuple(Part(part.hf.format(e=e), part.shape, part.split)
                     for e in range(config.moe.num_experts) for part in self.parts)

    @property
    def linear(self) -> bool:
        """A projection's weight matrix (what ``--quantization fp8`` quantizes in a layer)."""
        return self.init == "linear"


LAYER_PREFIX = "model.layers.{n}."
#: The output head when the config ties it to the embedding: not in the checkpoint
#: (or ignored there), the embedding's tensor itself.
HEAD, EMBED = "lm_head", "embed"


@dataclass(frozen=True, slots=True)
class WeightTable:
    """Every parameter of a model: one layer's, then the rest (embedding, head, final
    norm), each list in the order random weights are drawn."""

    layer: tuple[Param, ...]
    top: tuple[Param, ...]

    def top_params(self, config: ModelConfig) -> Iterator[Param]:
        """The top-level parameters that have tensors of their own."""
        return (p for p in self.top if not (p.name == HEAD and config.tie_word_embeddings))

    def hf_names(self, config: ModelConfig) -> Iterator[tuple[str, Param, Part]]:
        """(HF name, parameter, part) of every tensor a checkpoint must hold."""
        for n in range(config.num_layers):
            prefix = LAYER_PREFIX.format(n=n)
            for param in self.layer:
                for part in param.parts_for(config):
                    yield prefix + part.hf, param, part
        for param in self.top_params(config):
            for part in param.parts_for(config):
                yield part.hf, param, part

    def shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """HF's tensor names and shapes for ``config``."""
        return {name: part.shape(config) for name, _, part in self.hf_names(config)}

    def parameter_count(self, config: ModelConfig) -> int:
        return sum(math.prod(shape) for shape in self.shapes(config).values())

    def linear_shapes(self, config: ModelConfig) -> list[tuple[int, int]]:
        """The [N, K] of one layer's linear weights (each packed parameter as one; an
        expert parameter with every expert's rows)."""
        shapes = []
        for param in self.layer:
            if param.linear:
                parts = [part.shape(config) for part in param.parts_for(config)]
                shapes.append((sum(s[0] for s in parts), parts[0][1]))
        return shapes

    @property
    def moe(self) -> bool:
        """The layers' MLP is a mixture of experts."""
        return any(p.experts for p in self.layer)


def decoder_weights(*, qk_norm: bool, fused: bool = False, moe: bool = False) -> WeightTable:
    """The weights of a Llama-family decoder in HF's naming (pre-norm, GQA attention,
    gated MLP), ``qk_norm`` adding a per-head RMSNorm of q and k (Qwen3); ``fused``: the
    checkpoint holds q, k and v as one ``qkv_proj`` and gate and up as one
    ``gate_up_proj`` (Phi-3's, in the engine's own packing order); ``moe``: each layer's
    MLP is a router (``mlp.gate``) over experts, each a gated MLP of its own
    (``mlp.experts.{e}.*``, Qwen3-MoE's)."""

    def hidden(c: ModelConfig) -> tuple[int, ...]:
        return (c.hidden_size,)

    def head_dim(c: ModelConfig) -> tuple[int, ...]:
        return (c.head_dim,)

    norms = (Param("q_norm", (Part("self_attn.q_norm.weight", head_dim),), "norm"),
             Param("k_norm", (Part("self_attn.k_norm.weight", head_dim),), "norm"))
    qkv = ((Part("self_attn.qkv_proj.weight",
                 lambda c: (c.q_size + 2 * c.kv_size, c.hidden_size), "qkv"),) if fused else
           (Part("self_attn.q_proj.weight", lambda c: (c.q_size, c.hidden_size), "q_heads"),
            Part("self_attn.k_proj.weight", lambda c: (c.kv_size, c.hidden_size), "kv_heads"),
            Part("self_attn.v_proj.weight", lambda c: (c.kv_size, c.hidden_size), "kv_heads")))
    gate_up = ((Part("mlp.gate_up_proj.weight",
                     lambda c: (2 * c.intermediate_size, c.hidden_size), "gate_up"),) if fused else
               (Part("mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size), "rows"),
                Part("mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size), "rows")))
    mlp: tuple[Param, ...] = (
        Param("gate_up", gate_up),
        Param("down", (Part("mlp.down_proj.weight",
                            lambda c: (c.hidden_size, c.intermediate_size), "columns"),)),
    )
    if moe:
        mlp = (
            Param("router", (Part("mlp.gate.weight", lambda c: (_moe(c).num_experts, c.hidden_size)),)),
            Param("experts_gate_up", (
                Part("mlp.experts.{e}.gate_proj.weight",
                     lambda c: (_moe(c).intermediate, c.hidden_size), "rows"),
                Part("mlp.experts.{e}.up_proj.weight",
                     lambda c: (_moe(c).intermediate, c.hidden_size), "rows")),
                experts=True),
            Param("experts_down", (
                Part("mlp.experts.{e}.down_proj.weight",
                     lambda c: (c.hidden_size, _moe(c).intermediate), "columns"),),
                experts=True),
        )
    layer = (
        Param("input_norm", (Part("input_layernorm.weight", hidden),), "norm"),
        Param("qkv", qkv),
        *(norms if qk_norm else ()),
        Param("o_proj", (Part("self_attn.o_proj.weight", lambda c: (c.hidden_size, c.q_size),
                              "q_heads_in"),)),
        Param("post_norm", (Part("post_attention_layernorm.weight", hidden),), "norm"),
        *mlp,
    )
    top = (
        Param(EMBED, (Part("model.embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size)),)),
        Param(HEAD, (Part("lm_head.weight", lambda c: (c.vocab_size, c.hidden_size), "vocab"),)),
        Param("norm", (Part("model.norm.weight", hidden),), "norm"),
    )
    return WeightTable(layer, top)


@dataclass(frozen=True, slots=True)
class MoeShape:
    """A mixture-of-experts MLP's shape (Qwen3-MoE's config fields): ``num_experts``
    experts of ``intermediate`` (``moe_intermediate_size``), ``top_k``
    (``num_experts_per_tok``) of them routed a token, their weights renormalized to
    sum to 1 where ``norm_topk_prob``."""

    num_experts: int
    top_k: int
    intermediate: int
    norm_topk_prob: bool


#: The router's limits: a token's expert probabilities in one program, and its top k
#: picked one by one.
MAX_EXPERTS, MAX_TOP_K = 512, 16


def moe_shape(d: dict[str, Any]) -> MoeShape:
    """A MoE config's experts, checked (ValueError; KeyError for a missing field)."""
    shape = MoeShape(int(d["num_experts"]), int(d["num_experts_per_tok"]),
                     int(d["moe_intermediate_size"]), bool(d.get("norm_topk_prob", False)))
    if not 0 < shape.top_k <= min(shape.num_experts, MAX_TOP_K):
        raise ValueError(f"num_experts_per_tok {shape.top_k}: 1 to {MAX_TOP_K}, and at most "
                         "num_experts")
    if not 0 < shape.num_experts <= MAX_EXPERTS or shape.intermediate <= 0:
        raise ValueError(f"num_experts {shape.num_experts} (1 to {MAX_EXPERTS}) or "
                         f"moe_intermediate_size {shape.intermediate} out of range")
    return shape


def _moe(config: ModelConfig) -> MoeShape:
    if config.moe is None:
        raise ValueError("an expert parameter's shape needs a config with experts")
    return config.moe


@dataclass(frozen=True, slots=True)
class Llama3Scaling:
    """Llama 3.1's ``llama3`` RoPE scaling: frequencies whose wavelength exceeds
    ``original_max_position / low_freq_factor`` are divided by ``factor``, those under
    ``original_max_position / high_freq_factor`` kept, the ones between interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int

    @classmethod
    def parse(cls, entry: dict[str, Any], key: str, config: dict[str, Any]) -> Llama3Scaling:
        """The fields of a ``llama3`` entry, checked (ValueError). The pretraining length
        as transformers takes it: the config's own ``original_max_position_embeddings``
        first, then the entry's, then ``max_position_embeddings``."""
        original = config.get("original_max_position_embeddings",
                              entry.get("original_max_position_embeddings",
                                        config.get("max_position_embeddings")))
        try:
            if original is None:
                raise KeyError("original_max_position_embeddings")
            scaling = cls(float(entry["factor"]), float(entry["low_freq_factor"]),
                          float(entry["high_freq_factor"]), int(original))
        except KeyError as exc:
            raise ValueError(f"{key}: the llama3 scaling needs {exc}") from None
        if not (scaling.factor >= 1 and 0 < scaling.low_freq_factor < scaling.high_freq_factor
                and scaling.original_max_position > 0):
            raise ValueError(f"{key}: llama3 scaling {entry!r} out of range (factor >= 1, "
                             "0 < low_freq_factor < high_freq_factor, "
                             "original_max_position_embeddings > 0)")
        return scaling


@dataclass(frozen=True, slots=True)
class Rope:
    """A config's RoPE, from either of transformers' layouts (``rope_settings``)."""

    theta: float
    #: The scaling type; None for plain RoPE (no entry, or transformers 5's "default").
    kind: str | None
    #: The share of a head's dimensions rotated (Phi's), where a config says.
    partial: float | None
    #: The key that said so, for the messages.
    key: str
    #: The ``llama3`` scaling's fields, where that is the type.
    llama3: Llama3Scaling | None = None


def rope_settings(d: dict[str, Any]) -> Rope:
    """A config.json's RoPE: transformers 5 writes ``rope_parameters`` (``rope_theta``,
    ``rope_type``, the scaling's fields) and no top-level ``rope_theta``; earlier
    versions, ``rope_theta`` and ``rope_scaling`` (null for plain RoPE). ValueError for
    an entry that is not an object."""
    params = d.get("rope_parameters")
    if params is not None:
        key, scaling, theta = "rope_parameters", params, None
    else:
        key, scaling, theta = "rope_scaling", d.get("rope_scaling"), d.get("rope_theta")
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"{key} = {scaling!r} is not an object")
    scaling = scaling or {}
    theta = scaling.get("rope_theta", theta)
    kind = scaling.get("rope_type", scaling.get("type"))
    partial = scaling.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    llama3 = Llama3Scaling.parse(scaling, key, d) if kind == "llama3" else None
    return Rope(10000.0 if theta is None else float(theta),
                None if kind in (None, "default") else str(kind), partial, key, llama3)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """An architecture as the engine serves it: config.json's ``model_type``, the
    decoder class (``module:Class`` in ``dpu_frontend.model.models``, imported only
    when a runner builds it: it needs torch), and the options it implements. A config
    asking for an option the spec does not implement is refused at start-up rather
    than served wrong."""

    model_type: str
    implementation: str
    weights: WeightTable
    #: The ``rope_scaling`` types its rotary table implements (none: plain RoPE).
    rope_scaling: tuple[str, ...] = ()
    #: MLP activations it implements (config.json's ``hidden_act``).
    activations: tuple[str, ...] = ("silu",)

    @property
    def qk_norm(self) -> bool:
        """A per-head RMSNorm of q and k before RoPE: the table has their weights."""
        return any(p.name == "q_norm" for p in self.weights.layer)

    def check(self, d: dict[str, Any]) -> None:
        """Refuse what this architecture's implementation does not do (ValueError)."""
        model_type = d.get("model_type", self.model_type)
        if model_type != self.model_type:
            raise ValueError(f"model_type {model_type!r} does not match the architecture's "
                             f"({self.model_type!r})")
        rope = rope_settings(d)
        if rope.kind is not None and rope.kind not in self.rope_scaling:
            raise ValueError(f"{rope.key} = {d[rope.key]!r} is not implemented by this engine "
                             f"for {self.model_type}")
        if rope.partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor = {rope.partial!r} is not implemented by "
                             "this engine (RoPE over every dimension of a head only)")
        for key, refused in (("attention_bias", False), ("mlp_bias", False),
                             ("use_sliding_window", False)):
            if d.get(key, refused) != refused:
                raise ValueError(f"{key} = {d[key]!r} is not implemented by this engine")
        # A window applies unless the config turns it off (Qwen's use_sliding_window);
        # Mistral-7B v0.1's 4,096 does.
        if d.get("sliding_window") is not None and d.get("use_sliding_window", True):
            raise ValueError(f"sliding_window = {d['sliding_window']!r} is not implemented by "
                             "this engine")
        if self.weights.moe:
            # Every layer's MLP sparse (Qwen3-30B-A3B's, and Qwen3-235B-A22B's).
            if d.get("decoder_sparse_step", 1) != 1 or d.get("mlp_only_layers"):
                raise ValueError(f"decoder_sparse_step = {d.get('decoder_sparse_step')!r}, "
                                 f"mlp_only_layers = {d.get('mlp_only_layers')!r}: dense "
                                 "layers among the sparse ones are not implemented by this "
                                 "engine")
            if d.get("shared_expert_intermediate_size"):
                raise ValueError("a shared expert is not implemented by this engine")
        act = d.get("hidden_act", "silu")
        if act not in self.activations:
            raise ValueError(f"hidden_act {act!r} is not implemented "
                             f"({', '.join(self.activations)} only)")


class Decoder(Protocol):
    """A model the runner drives: one forward over a flat batch of tokens from many
    sequences (prefill chunks and decodes mixed), and the logits of the rows asked for."""

    config: ModelConfig
    params: Params
    cache: KvCache

    def forward(self, input_ids: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Hidden states after the last layer (before the final norm), [T, hidden]."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the given rows."""


class DecoderClass(Protocol):
    """How the runner builds a model: its config, its weights, the KV cache, the longest
    context (its rotary table's length); under tensor parallelism, a rank's config and
    weights (``tensor_parallel.Shard``) and its group (``layers.collective``)."""

    def __call__(self, config: ModelConfig, params: Params, cache: KvCache,
                 max_position: int, group: TensorGroup | None = None) -> Decoder: ...
