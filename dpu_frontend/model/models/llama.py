"""The Llama family's decoder: pre-norm layers of grouped-query attention with RoPE and
a SwiGLU MLP, and, where the weight table has them (Qwen3), a per-head RMSNorm of q
and k before RoPE.

The arithmetic follows HF ``transformers``' Llama and Qwen3 step for step (the GPU
tests hold Qwen3 to that): RMSNorm in float32 rounded to the model dtype, the q/k-norm
per head before RoPE, RoPE with ``rotate_half`` and cos/sin in the model dtype,
SwiGLU, residual adds in the model dtype. Its weights: ``registry``'s line,
``decoder_weights(qk_norm=...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.layers.attention import Attention, KvCache, paged_attention
from dpu_frontend.model.layers.collective import TensorGroup
from dpu_frontend.model.layers.linear import linear
from dpu_frontend.model.layers.norm import rms_norm, rms_norm_fp8
from dpu_frontend.model.layers.quant import Fp8Rows, Fp8Weight, Weight
from dpu_frontend.model.layers.rope import RotaryTable, qk_norm_rope
from dpu_frontend.model.weights import Params


@dataclass(kw_only=True)
class AttentionLayer:
    """A layer's attention parameters and norms, by the weight table's names."""

    input_norm: torch.Tensor
    qkv: Weight  # [q_size + 2 kv_size, hidden]: q_proj, k_proj, v_proj stacked
    o_proj: Weight
    post_norm: torch.Tensor
    # The per-head norms of q and k (Qwen3's); None where the table has none (Llama's).
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


@dataclass(kw_only=True)
class Layer(AttentionLayer):
    """A layer with a dense gated MLP."""

    gate_up: Weight  # [2 intermediate, hidden]: gate_proj, up_proj stacked
    down: Weight


class Llama:
    #: A layer's parameters: the weight table's names for one layer.
    layer_class: type[AttentionLayer] = Layer

    def __init__(self, config: ModelConfig, params: Params, cache: KvCache,
                 max_position: int, group: TensorGroup | None = None) -> None:
        self.config = config
        self.params = params
        self.cache = cache
        #: Tensor parallelism: this rank's ``config`` is its ``Shard.local_config`` and
        #: ``params`` its cut (``tensor_parallel``); each layer's two projections back to
        #: the hidden size give partial sums that ``group`` adds in rank order, the
        #: residual carried by rank 0's; the head's logits are gathered by vocabulary.
        self.group = group
        self.layers = [self.layer_class(**layer) for layer in params.layers]
        #: FP8 linear weights (``--quantization fp8``): the norms before them quantize the
        #: rows they make, in the same launch.
        self.fp8 = any(isinstance(w, Fp8Weight) for w in params.layers[0].values())
        self.embed, self.norm, self.lm_head = (params.top[n] for n in ("embed", "norm", "lm_head"))
        self.rotary = RotaryTable(config.head_dim, config.rope_theta, max_position,
                                  self.embed.dtype, self.embed.device, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, attn: Attention) -> torch.Tensor:
        """Hidden states after the last layer (before the final norm), [T, hidden]."""
        c = self.config
        eps = c.rms_norm_eps
        k_cache, v_cache = self.cache.k, self.cache.v
        cos, sin = self.rotary.cos, self.rotary.sin
        h = F.embedding(input_ids, self.embed)
        t = h.shape[0]
        for n, layer in enumerate(self.layers):
            k_scale, v_scale = self.cache.scales(n)
            x = self._norm(h, layer.input_norm)
            q = qk_norm_rope(linear(x, layer.qkv), layer.q_norm, layer.k_norm, eps, cos, sin,
                             attn.positions, k_cache[n], v_cache[n], attn.cache_slots,
                             c.num_heads, c.num_kv_heads, k_scale, v_scale)
            o = torch.empty_like(q)
            paged_attention(q, k_cache[n], v_cache[n], attn.tables, attn.tile_seq, attn.tile_row,
                            attn.q_start, attn.q_len, attn.ctx_start, attn.positions, o,
                            tall=attn.tall, k_scale=k_scale, v_scale=v_scale)
            h = self._reduce(linear(o.reshape(t, c.q_size), layer.o_proj,
                                    residual=self._residual(h)))
            h = self._reduce(self._mlp(layer, self._norm(h, layer.post_norm),
                                       self._residual(h)))
        return h

    def _residual(self, h: torch.Tensor) -> torch.Tensor | None:
        """What a projection back to the hidden size adds to its product: ``h`` on one
        GPU, and under tensor parallelism on rank 0 alone (the sum over ranks adds it
        once)."""
        return h if self.group is None or self.group.rank == 0 else None

    def _reduce(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.group is None else self.group.all_reduce(h)

    def _mlp(self, layer: AttentionLayer, x: torch.Tensor | Fp8Rows,
             residual: torch.Tensor | None) -> torch.Tensor:
        """``residual`` (where there is one) + the MLP of the post-attention norm's rows
        ``x``."""
        assert isinstance(layer, Layer)
        return linear(linear(x, layer.gate_up, gated=True), layer.down, residual=residual)

    def _norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | Fp8Rows:
        eps = self.config.rms_norm_eps
        return rms_norm_fp8(h, weight, eps) if self.fp8 else rms_norm(h, weight, eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the given rows."""
        x = rms_norm(hidden, self.norm, self.config.rms_norm_eps)
        logits = linear(x, self.lm_head, out_dtype=torch.float32)
        if self.group is None:
            return logits
        return self.group.gather_columns(logits, self.config.vocab_size)
