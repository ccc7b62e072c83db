"""The fused attention inputs (``rope.qk_norm_rope``) on a real GPU: bit for bit the
unfused layers (the per-head RMSNorm, RoPE, the cache writes), a token's bits the
same alone and in a batch."""

from __future__ import annotations

import pytest
import torch

from dpu_frontend.model.layers.norm import rms_norm
from dpu_frontend.model.layers.rope import RotaryTable, qk_norm_rope, rope

pytestmark = pytest.mark.gpu

PAGE, BLOCKS, EPS = 16, 40, 1e-6


def unfused(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
            table: RotaryTable, positions: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, slots: torch.Tensor, heads: int,
            kv_heads: int) -> torch.Tensor:
    """What the model ran before the fusion (issue 23's Qwen3.forward)."""
    t, dim = qkv.shape[0], k_cache.shape[-1]
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.reshape(t, heads, dim), k.reshape(t, kv_heads, dim)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, EPS), rms_norm(k, k_norm, EPS)
    else:
        q, k = q.contiguous(), k.contiguous()
    rope(q, table.cos, table.sin, positions)
    rope(k, table.cos, table.sin, positions, k_cache, slots)
    v_cache[slots // PAGE, :, slots % PAGE] = v.reshape(t, kv_heads, dim)
    return q


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "dtype", "norm"), [
    (16, 8, 128, torch.bfloat16, True),  # Qwen3-0.6B
    (32, 8, 128, torch.bfloat16, True),  # Qwen3-8B
    (64, 8, 128, torch.float32, True),  # Qwen3-32B, float32 (the exactness tests)
    (32, 8, 128, torch.float16, False),  # no q/k norm (the Llama family)
])
def test_bit_for_bit_the_unfused_layers(heads: int, kv_heads: int, dim: int,
                                        dtype: torch.dtype, norm: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(heads * dim)
    table = RotaryTable(dim, 1e6, 4096, dtype, torch.device("cuda"))
    t = 300
    qkv = torch.randn((t, (heads + 2 * kv_heads) * dim), generator=gen, device="cuda").to(dtype)
    q_norm, k_norm = ((1 + 0.1 * torch.randn(dim, generator=gen, device="cuda")).to(dtype)
                      for _ in range(2)) if norm else (None, None)
    positions = torch.randint(0, 4096, (t,), generator=gen, device="cuda")
    slots = torch.randperm(BLOCKS * PAGE, generator=gen, device="cuda")[:t]

    def caches() -> list[torch.Tensor]:
        return [torch.full((BLOCKS, kv_heads, PAGE, dim), float("nan"), device="cuda",
                           dtype=dtype) for _ in range(2)]

    want_k, want_v = caches()
    want = unfused(qkv.clone(), q_norm, k_norm, table, positions, want_k, want_v, slots, heads, kv_heads)
    got_k, got_v = caches()
    got = qk_norm_rope(qkv.clone(), q_norm, k_norm, EPS, table.cos, table.sin, positions, got_k, got_v,
                       slots, heads, kv_heads)
    assert torch.equal(got, want)
    # NaN where nothing was written: equal_nan compares the written slots and the rest.
    assert torch.allclose(got_k, want_k, rtol=0, atol=0, equal_nan=True)
    assert torch.allclose(got_v, want_v, rtol=0, atol=0, equal_nan=True)
    # A token alone gets the bits it has in the batch.
    for i in (0, 137, t - 1):
        k1, v1 = caches()
        one = qk_norm_rope(qkv[i:i + 1].clone(), q_norm, k_norm, EPS, table.cos, table.sin,
                           positions[i:i + 1], k1, v1, slots[i:i + 1], heads, kv_heads)
        assert torch.equal(one[0], got[i])


def test_mismatched_inputs_are_refused() -> None:
    table = RotaryTable(128, 1e6, 64, torch.bfloat16, torch.device("cuda"))
    cache = torch.zeros((4, 8, PAGE, 128), device="cuda", dtype=torch.bfloat16)
    qkv = torch.zeros((2, 30 * 128), device="cuda", dtype=torch.bfloat16)
    positions = slots = torch.zeros(2, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="heads"):
        qk_norm_rope(qkv, None, None, EPS, table.cos, table.sin, positions, cache, cache.clone(),
                     slots, 16, 8)
