"""Qwen3: the Llama family's decoder (``llama.Llama``) with a per-head RMSNorm of q and k
before RoPE: its weight table (``decoder_weights(qk_norm=True)``) carries the two
norms' weights, and the decoder applies them where a layer has them. The GPU tests hold
it to HF ``transformers``' Qwen3 step for step.
"""

from __future__ import annotations

from dpu_frontend.model.models.llama import Llama


class Qwen3(Llama):
    """Qwen3's decoder: the family's, its layers with q and k norms."""
