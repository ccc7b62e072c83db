"""Qwen3: a Llama-family decoder with a per-head RMSNorm of q and k before RoPE.

The arithmetic follows HF ``transformers``' Qwen3 step for step (the GPU tests
hold it to that): RMSNorm in float32 rounded to the model dtype, q/k-norm per
head before RoPE, RoPE with ``rotate_half`` and cos/sin in the model dtype,
SwiGLU, residual adds in the model dtype. Its weights: ``registry``'s line,
``decoder_weights(qk_norm=True)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.layers.attention import Attention, KvCache, paged_attention
from dpu_frontend.model.layers.linear import linear
from dpu_frontend.model.layers.norm import rms_norm
from dpu_frontend.model.layers.rope import RotaryTable, rope
from dpu_frontend.model.weights import Params


@dataclass
class Layer:
    """One layer's parameters, by the weight table's names."""

    input_norm: torch.Tensor
    qkv: torch.Tensor  # [q_size + 2 kv_size, hidden]: q_proj, k_proj, v_proj stacked
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 intermediate, hidden]: gate_proj, up_proj stacked
    down: torch.Tensor


class Qwen3:
    def __init__(self, config: ModelConfig, params: Params, cache: KvCache,
                 max_position: int) -> None:
        self.config = config
        self.params = params
        self.cache = cache
        self.layers = [Layer(**layer) for layer in params.layers]
        self.embed, self.norm, self.lm_head = (params.top[n] for n in ("embed", "norm", "lm_head"))
        self.rotary = RotaryTable(config.head_dim, config.rope_theta, max_position,
                                  self.embed.dtype, self.embed.device)

    def forward(self, input_ids: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Hidden states after the last layer (before the final norm), [T, hidden]."""
        c = self.config
        eps = c.rms_norm_eps
        k_cache, v_cache = self.cache.k, self.cache.v
        page = self.cache.page
        blocks = attn.cache_slots // page
        offsets = attn.cache_slots % page
        cos, sin = self.rotary.cos, self.rotary.sin
        h = F.embedding(input_ids, self.embed)
        t = h.shape[0]
        for n, layer in enumerate(self.layers):
            x = rms_norm(h, layer.input_norm, eps)
            qkv = linear(x, layer.qkv)
            q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
            q = rms_norm(q.reshape(t, c.num_heads, c.head_dim), layer.q_norm, eps)
            k = rms_norm(k.reshape(t, c.num_kv_heads, c.head_dim), layer.k_norm, eps)
            rope(q, cos, sin, attn.positions)
            rope(k, cos, sin, attn.positions, k_cache[n], attn.cache_slots)
            v_cache[n, blocks, :, offsets] = v.reshape(t, c.num_kv_heads, c.head_dim)
            o = torch.empty_like(q)
            paged_attention(q, k_cache[n], v_cache[n], attn.tables, attn.tile_seq, attn.tile_row,
                            attn.q_start, attn.q_len, attn.ctx_start, attn.positions, o)
            h = linear(o.reshape(t, c.q_size), layer.o_proj, residual=h)
            x = rms_norm(h, layer.post_norm, eps)
            h = linear(linear(x, layer.gate_up, gated=True), layer.down, residual=h)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the given rows."""
        x = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        return linear(x, self.lm_head, out_dtype=torch.float32)
