"""The Qwen3 decoder over a paged KV cache.

One forward takes a flat batch of tokens from many sequences (prefill chunks
and decodes mixed) and returns the hidden states of the rows asked for. The
arithmetic follows HF ``transformers``' Qwen3 step for step (the tests hold
it to that): RMSNorm in float32 rounded to the model dtype, q/k-norm per
head before RoPE, RoPE with ``rotate_half`` and cos/sin in the model dtype,
SwiGLU, residual adds in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpu_frontend.model import kernels
from dpu_frontend.model.checkpoint import Checkpoint
from dpu_frontend.model.config import ModelConfig

_TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass
class Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q_size + 2 kv_size, hidden]: q_proj, k_proj, v_proj stacked
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 intermediate, hidden]: gate_proj, up_proj stacked
    down: torch.Tensor


@dataclass
class Weights:
    embed: torch.Tensor
    layers: list[Layer]
    norm: torch.Tensor
    lm_head: torch.Tensor  # the embedding itself when tied

    @classmethod
    def random(cls, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               seed: int) -> Weights:
        """Seeded random weights built on the GPU: real arithmetic, gibberish text.

        Linear weights are N(0, 0.02) as HF initializes them; the norms' weights
        are drawn around 1 so that they are exercised too.
        """
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)

        def normal(*shape: int, mean: float = 0.0, std: float = 0.02) -> torch.Tensor:
            t = torch.empty(shape, dtype=torch.float32, device=device)
            return t.normal_(mean, std, generator=gen).to(dtype)

        h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
        layers = [
            Layer(
                input_norm=normal(h, mean=1.0, std=0.1),
                qkv=normal(config.q_size + 2 * config.kv_size, h),
                q_norm=normal(d, mean=1.0, std=0.1), k_norm=normal(d, mean=1.0, std=0.1),
                o_proj=normal(h, config.q_size), post_norm=normal(h, mean=1.0, std=0.1),
                gate_up=normal(2 * i, h), down=normal(h, i),
            )
            for _ in range(config.num_layers)
        ]
        embed = normal(config.vocab_size, h)
        head = embed if config.tie_word_embeddings else normal(config.vocab_size, h)
        return cls(embed, layers, normal(h, mean=1.0, std=0.1), head)

    @classmethod
    def load(cls, checkpoint: Checkpoint, config: ModelConfig, dtype: torch.dtype,
             device: torch.device) -> Weights:
        """Every tensor copied from the mapped files to the device, in ``dtype``."""

        def get(name: str) -> torch.Tensor:
            ref = checkpoint.tensors[name]
            host = torch.frombuffer(checkpoint.data(name), dtype=_TORCH_DTYPES[ref.dtype])
            return host.view(ref.shape).to(device=device, dtype=dtype)

        layers = []
        for n in range(config.num_layers):
            p = f"model.layers.{n}."
            layers.append(Layer(
                input_norm=get(p + "input_layernorm.weight"),
                qkv=torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                q_norm=get(p + "self_attn.q_norm.weight"),
                k_norm=get(p + "self_attn.k_norm.weight"),
                o_proj=get(p + "self_attn.o_proj.weight"),
                post_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                down=get(p + "mlp.down_proj.weight"),
            ))
        embed = get("model.embed_tokens.weight")
        head = embed if config.tie_word_embeddings else get("lm_head.weight")
        return cls(embed, layers, get("model.norm.weight"), head)

    def state_dict(self, config: ModelConfig) -> dict[str, torch.Tensor]:
        """HF's names for these weights (the tests hand them to ``transformers``)."""
        out = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        q, kv, i = config.q_size, config.kv_size, config.intermediate_size
        for n, layer in enumerate(self.layers):
            p = f"model.layers.{n}."
            out |= {
                p + "input_layernorm.weight": layer.input_norm,
                p + "self_attn.q_proj.weight": layer.qkv[:q],
                p + "self_attn.k_proj.weight": layer.qkv[q:q + kv],
                p + "self_attn.v_proj.weight": layer.qkv[q + kv:],
                p + "self_attn.q_norm.weight": layer.q_norm,
                p + "self_attn.k_norm.weight": layer.k_norm,
                p + "self_attn.o_proj.weight": layer.o_proj,
                p + "post_attention_layernorm.weight": layer.post_norm,
                p + "mlp.gate_proj.weight": layer.gate_up[:i],
                p + "mlp.up_proj.weight": layer.gate_up[i:],
                p + "mlp.down_proj.weight": layer.down,
            }
        if not config.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head
        return out


@dataclass
class Attention:
    """Where this step's tokens go in the cache and what each query sees."""

    positions: torch.Tensor  # [T] int64
    cache_slots: torch.Tensor  # [T] int64: block * page + offset
    tables: torch.Tensor  # [S, max_blocks] int32
    tile_seq: torch.Tensor  # [tiles] int32
    tile_row: torch.Tensor  # [tiles] int32
    q_start: torch.Tensor  # [S] int32
    q_len: torch.Tensor  # [S] int32
    ctx_start: torch.Tensor  # [S] int32


class RotaryTable:
    """cos and sin for every position, in the model dtype (as HF applies them)."""

    def __init__(self, config: ModelConfig, max_position: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        d = config.head_dim
        # HF computes inv_freq on the CPU in float32; so do we, for the same bits.
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        pos = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = pos[:, None] * inv_freq.to(device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)


class Qwen3:
    def __init__(self, config: ModelConfig, weights: Weights, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, rotary: RotaryTable) -> None:
        self.config = config
        self.weights = weights
        self.k_cache = k_cache  # [layers, blocks, kv_heads, page, head_dim]
        self.v_cache = v_cache
        self.rotary = rotary

    def forward(self, input_ids: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Hidden states after the last layer (before the final norm), [T, hidden]."""
        c, w = self.config, self.weights
        eps = c.rms_norm_eps
        page = self.k_cache.shape[3]
        blocks = attn.cache_slots // page
        offsets = attn.cache_slots % page
        cos, sin = self.rotary.cos, self.rotary.sin
        h = F.embedding(input_ids, w.embed)
        t = h.shape[0]
        for n, layer in enumerate(w.layers):
            x = kernels.rms_norm(h, layer.input_norm, eps)
            qkv = kernels.linear(x, layer.qkv)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = kernels.rms_norm(q.reshape(t, c.num_heads, c.head_dim), layer.q_norm, eps)
            k = kernels.rms_norm(k.reshape(t, c.num_kv_heads, c.head_dim), layer.k_norm, eps)
            kernels.rope(q, cos, sin, attn.positions)
            kernels.rope(k, cos, sin, attn.positions, self.k_cache[n], attn.cache_slots)
            self.v_cache[n, blocks, :, offsets] = v.reshape(t, c.num_kv_heads, c.head_dim)
            o = torch.empty_like(q)
            kernels.paged_attention(q, self.k_cache[n], self.v_cache[n], attn.tables, attn.tile_seq,
                                    attn.tile_row, attn.q_start, attn.q_len, attn.ctx_start,
                                    attn.positions, o)
            h = h + kernels.linear(o.reshape(t, c.q_size), layer.o_proj)
            x = kernels.rms_norm(h, layer.post_norm, eps)
            h = h + kernels.linear(kernels.silu_mul(kernels.linear(x, layer.gate_up)), layer.down)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the given rows."""
        x = kernels.rms_norm(hidden, self.weights.norm, self.config.rms_norm_eps)
        return kernels.linear(x, self.weights.lm_head, out_dtype=torch.float32)
