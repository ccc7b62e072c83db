"""Qwen3-MoE (Qwen3-30B-A3B): Qwen3's decoder (``qwen3.Qwen3``: attention with q and k
norms) whose every MLP is a mixture of experts: a router (``mlp.gate``) picks each
token's top k of the experts, each a gated MLP, and their outputs are summed by the
router's weights (``layers.moe``). The GPU tests hold it to HF ``transformers``'
``Qwen3MoeForCausalLM``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.layers.attention import KvCache
from dpu_frontend.model.layers.collective import TensorGroup
from dpu_frontend.model.layers.linear import linear
from dpu_frontend.model.layers.moe import moe_mlp
from dpu_frontend.model.layers.quant import Fp8Rows
from dpu_frontend.model.models.llama import AttentionLayer
from dpu_frontend.model.models.qwen3 import Qwen3
from dpu_frontend.model.weights import Params


@dataclass(kw_only=True)
class MoeLayer(AttentionLayer):
    """A layer whose MLP is a mixture of experts."""

    router: torch.Tensor  # [experts, hidden]
    experts_gate_up: torch.Tensor  # [experts x 2 intermediate, hidden]: each gate, then up
    experts_down: torch.Tensor  # [experts x hidden, intermediate]


class Qwen3Moe(Qwen3):
    layer_class = MoeLayer

    def __init__(self, config: ModelConfig, params: Params, cache: KvCache,
                 max_position: int, group: TensorGroup | None = None) -> None:
        super().__init__(config, params, cache, max_position, group)
        if config.moe is None:
            raise ValueError("Qwen3-MoE needs a config with experts")
        self.moe = config.moe

    def _mlp(self, layer: AttentionLayer, x: torch.Tensor | Fp8Rows,
             residual: torch.Tensor | None) -> torch.Tensor:
        assert isinstance(layer, MoeLayer) and isinstance(x, torch.Tensor)
        m = self.moe
        experts, hidden = m.num_experts, self.config.hidden_size
        # The experts' sum adds a residual: a rank after the first adds zeros.
        return moe_mlp(x, linear(x, layer.router), layer.experts_gate_up.view(experts, -1, hidden),
                       layer.experts_down.view(experts, hidden, m.intermediate),
                       torch.zeros_like(x) if residual is None else residual, m.top_k,
                       m.norm_topk_prob)
