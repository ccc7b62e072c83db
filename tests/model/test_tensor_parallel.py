"""Tensor parallelism's split (``model.tensor_parallel``), on the CPU: which rows and
columns of each weight go to which rank, the shapes each rank then runs, and, for
every served architecture, a decoder in float64 NumPy whose ranks' partial sums, added
in rank order, give the whole model's logits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dpu_frontend.model import registry
from dpu_frontend.model.config import QWEN3_0_6B, ModelConfig
from dpu_frontend.model.models.base import EMBED, HEAD, LAYER_PREFIX, Param
from dpu_frontend.model.tensor_parallel import MAX_SIZE, Shard, check

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"

#: Small configs of each architecture: 8 query and 2 KV heads of 64 (so that 4 and 8
#: ranks share KV heads), and a vocabulary that no rank count divides.
SMALL = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
         "vocab_size": 203, "max_position_embeddings": 64}


def small(source: dict[str, Any], **change: Any) -> ModelConfig:
    data = source | SMALL | change
    data.pop("bos_token_id", None)
    data["eos_token_id"] = 1
    return ModelConfig.from_dict(data, "small")


def published(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return data


MODELS = {
    "qwen3-tied": lambda: small(QWEN3_0_6B),
    "llama": lambda: small(published("llama-3-8b")),
    "phi3-fused": lambda: small(published("phi-4")),
    "qwen3-moe": lambda: small(published("qwen3-30b-a3b"), num_experts=8,
                               num_experts_per_tok=2, moe_intermediate_size=64),
}
SIZES = (1, 2, 4, 8)


def hf_tensors(config: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Every HF tensor of ``config``, drawn as its weight table names it: norms near 1."""
    rng = np.random.default_rng(seed)
    table = registry.spec(config.architecture).weights
    return {name: (1.0 if param.init == "norm" else 0.0)
            + rng.standard_normal(part.shape(config)) * (0.1 if param.init == "norm" else 0.2)
            for name, param, part in table.hf_names(config)}


def packed(shard: Shard, tensors: dict[str, np.ndarray], prefix: str,
           param: Param) -> np.ndarray:
    parts = [tensors[prefix + part.hf] for part in param.parts_for(shard.config)]
    return shard.take(param, parts, np.concatenate)


def rank_params(shard: Shard, tensors: dict[str, np.ndarray]
                ) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """A rank's layers and top parameters, cut as its loader would cut them."""
    c = shard.config
    table = registry.spec(c.architecture).weights
    layers = [{p.name: packed(shard, tensors, LAYER_PREFIX.format(n=n), p) for p in table.layer}
              for n in range(c.num_layers)]
    top = {p.name: packed(shard, tensors, "", p) for p in table.top_params(c)}
    if c.tie_word_embeddings:
        top[HEAD] = shard.tied_head(top[EMBED])
    return layers, top


def rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    normed: np.ndarray = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight
    return normed


def rope(x: np.ndarray, theta: float) -> np.ndarray:
    """RoPE over [T, heads, d] at positions 0..T-1 (``rotate_half``'s layout)."""
    t, _, d = x.shape
    inv = theta ** (-np.arange(0, d, 2) / d)
    angle = np.arange(t)[:, None] * inv[None, :]
    cos, sin = (np.concatenate([f(angle)] * 2, -1)[:, None, :] for f in (np.cos, np.sin))
    half = np.concatenate([-x[..., d // 2:], x[..., :d // 2]], -1)
    rotated: np.ndarray = x * cos + half * sin
    return rotated


def silu(x: np.ndarray) -> np.ndarray:
    activated: np.ndarray = x / (1 + np.exp(-x))
    return activated


def attention_partial(c: ModelConfig, p: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """This rank's heads, causal, then its columns of o_proj: [T, hidden], a partial sum."""
    t, d = x.shape[0], c.head_dim
    qkv = x @ p["qkv"].T
    q = qkv[:, :c.q_size].reshape(t, c.num_heads, d)
    k = qkv[:, c.q_size:c.q_size + c.kv_size].reshape(t, c.num_kv_heads, d)
    v = qkv[:, c.q_size + c.kv_size:].reshape(t, c.num_kv_heads, d)
    if c.qk_norm:
        q, k = rms(q, p["q_norm"], c.rms_norm_eps), rms(k, p["k_norm"], c.rms_norm_eps)
    q, k = rope(q, c.rope_theta), rope(k, c.rope_theta)
    k, v = (np.repeat(a, c.group_size, axis=1) for a in (k, v))
    scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(d)
    scores = np.where(np.tril(np.ones((t, t), bool))[None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.einsum("hts,shd->thd", weights, v).reshape(t, c.q_size)
    partial: np.ndarray = out @ p["o_proj"].T
    return partial


def mlp_partial(c: ModelConfig, p: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """This rank's share of the MLP (of every routed expert's in a mixture)."""
    if c.moe is None:
        gate, up = np.split(x @ p["gate_up"].T, 2, axis=-1)
        dense: np.ndarray = (silu(gate) * up) @ p["down"].T
        return dense
    m = c.moe
    logits = x @ p["router"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :m.top_k]
    chosen = np.take_along_axis(probs, top, -1)
    if m.norm_topk_prob:
        chosen /= chosen.sum(-1, keepdims=True)
    gate_up = p["experts_gate_up"].reshape(m.num_experts, 2 * m.intermediate, -1)
    down = p["experts_down"].reshape(m.num_experts, c.hidden_size, m.intermediate)
    out = np.zeros_like(x)
    for token in range(x.shape[0]):
        for e, w in zip(top[token], chosen[token], strict=True):
            gate, up = np.split(gate_up[e] @ x[token], 2)
            out[token] += w * (down[e] @ (silu(gate) * up))
    return out


def logits_over_ranks(config: ModelConfig, size: int, tensors: dict[str, np.ndarray],
                      ids: np.ndarray) -> np.ndarray:
    """The decoder run over ``size`` ranks: each layer's two partial sums added in rank
    order (the all-reduce), the head's rows gathered in rank order."""
    shards = [Shard(config, size, r) for r in range(size)]
    params = [rank_params(s, tensors) for s in shards]
    eps = config.rms_norm_eps
    h = params[0][1][EMBED][ids]  # the embedding is whole on every rank
    for n in range(config.num_layers):
        x = rms(h, params[0][0][n]["input_norm"], eps)
        h = h + sum_in_rank_order([attention_partial(s.local_config, layers[n], x)
                                   for s, (layers, _) in zip(shards, params, strict=True)])
        x = rms(h, params[0][0][n]["post_norm"], eps)
        h = h + sum_in_rank_order([mlp_partial(s.local_config, layers[n], x)
                                   for s, (layers, _) in zip(shards, params, strict=True)])
    x = rms(h, params[0][1]["norm"], eps)
    return np.concatenate([x @ top[HEAD].T for _, top in params], axis=-1)


def sum_in_rank_order(partials: list[np.ndarray]) -> np.ndarray:
    total = partials[0]
    for partial in partials[1:]:
        total = total + partial
    return total


@pytest.mark.parametrize("model", MODELS)
def test_the_ranks_partial_sums_give_the_whole_models_logits(model: str) -> None:
    config = MODELS[model]()
    tensors = hf_tensors(config, seed=7)
    ids = np.array([3, 17, 0, 202, 99, 64, 5])
    whole = logits_over_ranks(config, 1, tensors, ids)
    assert whole.shape == (len(ids), config.vocab_size)
    for size in SIZES:
        assert np.allclose(logits_over_ranks(config, size, tensors, ids), whole,
                           rtol=1e-10, atol=1e-10), (model, size)


@pytest.mark.parametrize("model", MODELS)
def test_each_rank_holds_what_its_local_config_runs(model: str) -> None:
    config = MODELS[model]()
    tensors = hf_tensors(config, seed=1)
    table = registry.spec(config.architecture).weights
    whole = Shard(config, 1, 0)
    for n in range(config.num_layers):
        prefix = LAYER_PREFIX.format(n=n)
        for param in table.layer:  # one rank: the parts concatenated, as the loader packs
            parts = [tensors[prefix + part.hf] for part in param.parts_for(config)]
            assert np.array_equal(packed(whole, tensors, prefix, param), np.concatenate(parts))
    for size in SIZES:
        for rank in range(size):
            shard = Shard(config, size, rank)
            local = shard.local_config
            layers, top = rank_params(shard, tensors)
            for param in table.layer:
                shapes = [part.shape(local) for part in param.parts_for(local)]
                expected = (sum(s[0] for s in shapes), *shapes[0][1:])
                assert layers[0][param.name].shape == expected, (model, size, param.name)
            first, end = shard.vocab
            assert top[HEAD].shape == (end - first, config.hidden_size)
            # A rank's query heads read only the KV heads it holds.
            assert {h // config.group_size for h in shard.q_heads} == set(shard.kv_heads)


@pytest.mark.parametrize("model", MODELS)
def test_every_element_goes_to_its_ranks_once(model: str) -> None:
    """Split tensors: each element on exactly one rank; k and v rows on ``size /
    num_kv_heads`` ranks where ranks share KV heads; whole tensors on every rank."""
    config = MODELS[model]()
    table = registry.spec(config.architecture).weights
    kv_copies = {size: max(1, size // config.num_kv_heads) for size in SIZES}
    for _, param, part in table.hf_names(config):
        shape = part.shape(config)
        for size in SIZES:
            counts = np.zeros(shape if len(shape) == 2 else (shape[0], 1), dtype=int)
            for rank in range(size):
                for block in Shard(config, size, rank).blocks(part):
                    cols = slice(*block.cols) if block.cols else slice(None)
                    counts[slice(*block.rows), cols] += 1
            expected = np.ones_like(counts)
            if part.split == "whole":
                expected *= size
            elif part.split == "kv_heads":
                expected *= kv_copies[size]
            elif part.split == "qkv":
                expected[config.q_size:] *= kv_copies[size]
            assert np.array_equal(counts, expected), (model, part.hf, size, param.name)


def test_the_split_of_the_models_people_run() -> None:
    """Qwen3-32B at 2 ranks and Llama-3-70B's shapes at 4, as issue 27 measures them."""
    qwen = ModelConfig.load(CONFIGS / "qwen3-32b.json")
    shard = Shard(qwen, 2, 1)
    assert (shard.q_heads, shard.kv_heads) == (range(32, 64), range(4, 8))
    assert shard.local_config.intermediate_size == 12800
    assert shard.vocab == (75968, 151936)
    llama = ModelConfig.load(CONFIGS / "llama-3-8b.json")
    big = ModelConfig.from_dict(
        published("llama-3-8b") | {"hidden_size": 8192, "intermediate_size": 28672,
                                   "num_hidden_layers": 80, "num_attention_heads": 64}, "70b")
    assert big.num_kv_heads == llama.num_kv_heads == 8
    local = Shard(big, 4, 3).local_config
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (16, 2, 7168)
    # The KV cache a rank holds: its KV heads' share of a token's bytes.
    assert local.kv_bytes_per_token(2) * 4 == big.kv_bytes_per_token(2)


@pytest.mark.parametrize(("size", "change", "message"), [
    (0, {}, "tensor parallel size 0: 1 to 8"),
    (MAX_SIZE + 1, {}, "tensor parallel size 9"),
    (3, {}, "num_attention_heads 8 is not a multiple of the tensor parallel size 3"),
    (4, {"num_key_value_heads": 8, "num_attention_heads": 8, "intermediate_size": 256},
     None),
    (4, {"intermediate_size": 250}, "intermediate_size 250"),
])
def test_splits_this_engine_cannot_make_are_refused(size: int, change: dict[str, Any],
                                                    message: str | None) -> None:
    config = small(QWEN3_0_6B, **change)
    if message is None:
        check(config, size)
        return
    with pytest.raises(ValueError, match=message):
        check(config, size)


def test_kv_heads_and_ranks_that_do_not_divide_are_refused() -> None:
    phi4 = ModelConfig.load(CONFIGS / "phi-4.json")  # 40 query and 10 KV heads
    check(phi4, 2)
    with pytest.raises(ValueError, match="num_key_value_heads 10 and the tensor parallel "
                                         "size 4: one must divide the other"):
        check(phi4, 4)
    moe = small(published("qwen3-30b-a3b"), num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=36)
    check(moe, 4)
    with pytest.raises(ValueError, match="moe_intermediate_size 36 is not a multiple of the "
                                         "tensor parallel size 8"):
        check(moe, 8)
    with pytest.raises(ValueError, match="rank 2 of 2"):
        Shard(moe, 2, 2)
