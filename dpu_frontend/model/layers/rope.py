# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Rotary position embedding: the cos/sin table and the kernel that rotates q and k
(and writes k into the paged cache on the way)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, cache_ptr, cache_slot_ptr,
                 stride_xt, stride_xh, stride_ct, stride_cb, stride_ch, stride_cs,
                 HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                 PAGE: tl.constexpr, TO_CACHE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, HEADS_P2)
    half = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    mask = (h < HEADS)[:, None]
    pos = tl.load(pos_ptr + t)
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    partner = tl.where(d < half, d + half, d - half)
    other = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + partner[None, :], mask=mask,
                    other=0.0)
    rotated = tl.where(d[None, :] < half, -other, other)
    cos = tl.load(cos_ptr + pos * stride_ct + d)
    sin = tl.load(sin_ptr + pos * stride_ct + d)
    # As torch computes x * cos + rotate_half(x) * sin in the model dtype: each
    # product rounded to it, then the sum.
    a = (x.to(tl.float32) * cos.to(tl.float32)[None, :]).to(x.dtype)
    b = (rotated.to(tl.float32) * sin.to(tl.float32)[None, :]).to(x.dtype)
    y = (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)
    # Every load of the row is done before this store: in place is safe.
    tl.debug_barrier()
    tl.store(out_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], y, mask=mask)
    if TO_CACHE:
        slot = tl.load(cache_slot_ptr + t)
        block = slot // PAGE
        offset = slot % PAGE
        tl.store(cache_ptr + block * stride_cb + h[:, None] * stride_ch + offset * stride_cs + d[None, :],
                 y, mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
         cache: torch.Tensor | None = None, cache_slots: torch.Tensor | None = None) -> torch.Tensor:
    """RoPE (``rotate_half``) on ``x`` [T, heads, D] in place; with ``cache``
    [blocks, heads, PAGE, D], the result is also stored at ``cache_slots``."""
    t, heads, dim = x.shape
    if t == 0:
        return x
    if cache is None or cache_slots is None:  # the cache arguments are unused: any tensor
        cache, cache_slots, to_cache = x.view(t, heads, 1, dim), positions, False
    else:
        to_cache = True
    _rope_kernel[(t,)](x, cos, sin, positions, x, cache, cache_slots,
                       x.stride(0), x.stride(1), cos.stride(0),
                       cache.stride(0), cache.stride(1), cache.stride(2),
                       HEADS=heads, HEADS_P2=triton.next_power_of_2(heads), HEAD_DIM=dim,
                       PAGE=cache.shape[2], TO_CACHE=to_cache, num_warps=4)
    return x


class RotaryTable:
    """cos and sin for every position up to ``max_position``, in the model dtype (as HF
    applies them), for heads of ``head_dim`` and the base ``theta``."""

    def __init__(self, head_dim: int, theta: float, max_position: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        d = head_dim
        # HF computes inv_freq on the CPU in float32; so do we, for the same bits.
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        pos = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = pos[:, None] * inv_freq.to(device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
