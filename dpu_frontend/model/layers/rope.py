# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Rotary position embedding: the cos/sin table and the kernels that rotate q and k.

``qk_norm_rope`` is what a decoder layer runs between its qkv projection and
attention, in one launch: the per-head RMSNorm of q and k (where the
architecture has it), RoPE, and the paged cache's writes of k and v. ``rope``
is the unfused rotation the tests hold it to, bit for bit, beside
``norm.rms_norm``."""

from __future__ import annotations

import math
from typing import Protocol

import torch
import triton
import triton.language as tl

from dpu_frontend.model.layers.norm import NORM_WARPS, rms_normalize
from dpu_frontend.model.layers.pdl import dependent_start, launch
from dpu_frontend.model.layers.quant import FP8, cache_scales, fp8_scale, to_fp8


@triton.jit
def _rotate(x, other, d, half, cos, sin):
    # As torch computes x * cos + rotate_half(x) * sin in the model dtype: each
    # product rounded to it, then the sum.
    rotated = tl.where(d < half, -other, other)
    a = (x.to(tl.float32) * cos.to(tl.float32)).to(x.dtype)
    b = (rotated.to(tl.float32) * sin.to(tl.float32)).to(x.dtype)
    return (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype)


@triton.jit
def _rope_kernel(x_ptr, cos_ptr, sin_ptr, pos_ptr, out_ptr, cache_ptr, cache_slot_ptr,
                 stride_xt, stride_xh, stride_ct, stride_cb, stride_ch, stride_cs,
                 HEADS: tl.constexpr, HEADS_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                 PAGE: tl.constexpr, TO_CACHE: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
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
    cos = tl.load(cos_ptr + pos * stride_ct + d)
    sin = tl.load(sin_ptr + pos * stride_ct + d)
    y = _rotate(x, other, d[None, :], half, cos[None, :], sin[None, :])
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
    elif cache.dtype != x.dtype:
        raise ValueError("rope writes a cache of x's dtype (qk_norm_rope writes FP8 caches)")
    else:
        to_cache = True
    _rope_kernel[(t,)](x, cos, sin, positions, x, cache, cache_slots,
                       x.stride(0), x.stride(1), cos.stride(0),
                       cache.stride(0), cache.stride(1), cache.stride(2),
                       HEADS=heads, HEADS_P2=triton.next_power_of_2(heads), HEAD_DIM=dim,
                       PAGE=cache.shape[2], TO_CACHE=to_cache, **launch(x.device, (t,)), num_warps=4)
    return x


@triton.jit
def _to_cache(cache_ptr, scale_ptr, slot, head, d, y, stride_cb, stride_ch, stride_cs,
              stride_sb, stride_sh, PAGE: tl.constexpr, FP8_CACHE: tl.constexpr):
    # One head's K or V of a token into the paged cache at ``slot``: as it is, or in e4m3
    # with the head's scale for this token beside it (quant's rule).
    block = slot // PAGE
    offset = slot % PAGE
    at = cache_ptr + block * stride_cb + head * stride_ch + offset * stride_cs + d
    if FP8_CACHE:
        y = y.to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(y), axis=0))
        tl.store(at, to_fp8(y, scale))
        tl.store(scale_ptr + block * stride_sb + head * stride_sh + offset, scale)
    else:
        tl.store(at, y)


@triton.jit
def _qk_norm_rope_kernel(qkv_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, q_ptr,
                         k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr, eps, N,
                         stride_t, stride_qt, stride_ct, stride_cb, stride_ch, stride_cs,
                         stride_sb, stride_sh, HQ: tl.constexpr, HKV: tl.constexpr,
                         HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, NORM: tl.constexpr,
                         FP8_CACHE: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    # One program per token and head: q heads, then k heads, then v heads (qkv's order).
    t = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    row = qkv_ptr + t * stride_t + h * HEAD_DIM
    slot = tl.load(slot_ptr + t)
    if h >= HQ + HKV:  # v: into the cache as it is
        _to_cache(v_cache_ptr, v_scale_ptr, slot, h - HQ - HKV, d, tl.load(row + d), stride_cb,
                  stride_ch, stride_cs, stride_sb, stride_sh, PAGE, FP8_CACHE)
    else:
        if NORM:
            # The per-head norm, as norm.rms_norm runs a row (the same block and warps),
            # written back over the row: RoPE reads each element's partner from it.
            x = tl.load(row + d, mask=d < N, other=0.0).to(tl.float32)
            if h < HQ:
                w = tl.load(q_norm_ptr + d, mask=d < N, other=0.0)
            else:
                w = tl.load(k_norm_ptr + d, mask=d < N, other=0.0)
            tl.store(row + d, rms_normalize(x, w, N, eps).to(qkv_ptr.dtype.element_ty))
            tl.debug_barrier()
        half = HEAD_DIM // 2
        pos = tl.load(pos_ptr + t)
        x = tl.load(row + d)
        other = tl.load(row + tl.where(d < half, d + half, d - half))
        y = _rotate(x, other, d, half, tl.load(cos_ptr + pos * stride_ct + d),
                    tl.load(sin_ptr + pos * stride_ct + d))
        if h < HQ:
            tl.store(q_ptr + t * stride_qt + h * HEAD_DIM + d, y)
        else:
            _to_cache(k_cache_ptr, k_scale_ptr, slot, h - HQ, d, y, stride_cb, stride_ch,
                      stride_cs, stride_sb, stride_sh, PAGE, FP8_CACHE)


def qk_norm_rope(qkv: torch.Tensor, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                 eps: float, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, cache_slots: torch.Tensor,
                 heads: int, kv_heads: int, k_scale: torch.Tensor | None = None,
                 v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's attention inputs from its qkv projection [T, (Hq + 2 Hkv) D]: q [T, Hq, D]
    normed per head (with ``q_norm`` and ``k_norm``; neither: no norm) and rotated; k
    normed, rotated and v as it is, stored at ``cache_slots`` of the paged caches
    [blocks, Hkv, PAGE, D]. ``qkv`` is overwritten (its q and k rows normed). FP8 caches
    (``--kv-cache-dtype fp8``) take each head's values in e4m3 and their scale into
    ``k_scale`` and ``v_scale`` [blocks, Hkv, PAGE] (``quant``'s rule).

    Bit for bit ``rms_norm`` of q's and k's heads, then ``rope`` (k into the cache), and
    v copied into the cache, at a head size of 128 (every Qwen3 size's; measured on
    the H100, tests/gpu/test_qk_norm_rope.py). At 64, half of q's elements came out one
    unit in the last place from ``rope``'s, in 16-bit types; most likely the compiler
    contracts a product and the sum into one FMA in one of the two kernels' layouts
    and not in the other (docs/gpu.md). Both are batch-invariant: a token's bits never
    depend on the batch."""
    t = qkv.shape[0]
    dim = k_cache.shape[-1]
    q = torch.empty((t, heads, dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    if qkv.stride(-1) != 1 or qkv.shape[1] != (heads + 2 * kv_heads) * dim:
        raise ValueError(f"qkv of {tuple(qkv.shape)} for {heads} + 2 x {kv_heads} heads of {dim}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError("the K and V caches must have one shape and one layout")
    if k_cache.dtype not in (qkv.dtype, FP8) or k_cache.stride(-1) != 1:
        raise ValueError("the caches must hold qkv's dtype or FP8, in rows of unit stride")
    scales = cache_scales(k_cache, k_scale, v_scale)
    # The scales' pointers, unused for a cache of the model dtype: any tensor.
    k_scales, v_scales = scales or (k_cache, v_cache)
    if dim & (dim - 1):
        raise ValueError(f"a head size of {dim}: the kernel takes powers of two")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q and k are both normed or neither")
    if q_norm is not None and k_norm is not None and (q_norm.shape != (dim,)
                                                      or k_norm.shape != (dim,)):
        raise ValueError(f"q and k norms of {dim} weights each")
    norm = q_norm is not None
    _qk_norm_rope_kernel[(t, heads + 2 * kv_heads)](
        qkv, q_norm if norm else qkv, k_norm if norm else qkv, cos, sin, positions, q, k_cache,
        v_cache, k_scales, v_scales, cache_slots, eps, dim, qkv.stride(0), q.stride(0),
        cos.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scales.stride(0), k_scales.stride(1), HQ=heads, HKV=kv_heads, HEAD_DIM=dim,
        PAGE=k_cache.shape[2], NORM=norm, FP8_CACHE=scales is not None,
        **launch(qkv.device, (t, heads + 2 * kv_heads)), num_warps=NORM_WARPS)
    return q


class Llama3Scaling(Protocol):
    """Llama 3.1's RoPE scaling, as a config gives it (``models.base.Llama3Scaling``)."""

    @property
    def factor(self) -> float: ...
    @property
    def low_freq_factor(self) -> float: ...
    @property
    def high_freq_factor(self) -> float: ...
    @property
    def original_max_position(self) -> int: ...


def llama3_inv_freq(inv_freq: torch.Tensor, s: Llama3Scaling) -> torch.Tensor:
    """Llama 3.1's frequencies from plain RoPE's, in transformers' order of operations
    (``_compute_llama3_parameters``), for its bits."""
    low_freq_wavelen = s.original_max_position / s.low_freq_factor
    high_freq_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = ((s.original_max_position / wavelen - s.low_freq_factor)
              / (s.high_freq_factor - s.low_freq_factor))
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryTable:
    """cos and sin for every position up to ``max_position``, in the model dtype (as HF
    applies them), for heads of ``head_dim``, the base ``theta`` and, where a config
    has it, Llama 3.1's scaling."""

    def __init__(self, head_dim: int, theta: float, max_position: int, dtype: torch.dtype,
                 device: torch.device, scaling: Llama3Scaling | None = None) -> None:
        d = head_dim
        # HF computes inv_freq on the CPU in float32; so do we, for the same bits.
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        pos = torch.arange(max_position, dtype=torch.float32, device=device)
        freqs = pos[:, None] * inv_freq.to(device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)
