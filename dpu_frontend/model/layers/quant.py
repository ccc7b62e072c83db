# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""FP8 (e4m3): the opt-in weights and activations of ``--quantization fp8``, and the
scale rule that the KV cache's ``--kv-cache-dtype fp8`` shares.

Every scale is the amax of what it covers times the reciprocal of e4m3's largest
finite value (1/448, rounded to float32), and each value is divided by it, correctly
rounded, then rounded to e4m3 (to nearest, ties to even): the same bits from torch on
either device and from the kernels. A weight has one scale per output channel, computed
once at load; the activations entering a linear layer one per row, computed as
they are made; a cached K or V one per token and head, as it is written. None
depends on other rows: a maximum is exact in any order, so a row's scale and
its bits are the same alone and inside any batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dpu_frontend.model.layers.pdl import dependent_start, launch

#: e4m3's largest finite value: the amax of a row maps onto it.
FP8_MAX = 448.0
FP8 = torch.float8_e4m3fn
#: The smallest amax a scale is made from: an all-zero row scales by this over 448
#: (and stays zero), never by zero.
MIN_AMAX = 1e-12
#: A scale is the amax times this (a float32 multiply: a division by 448 may compile to
#: one, or not).
INV_FP8_MAX = 1.0 / FP8_MAX
# The same two numbers for the kernels (Triton reads globals only as constexprs).
_INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)
_MIN_AMAX = tl.constexpr(MIN_AMAX)


class Fp8Weight(NamedTuple):
    """A linear weight [N, K] in e4m3 and its float32 scale per output channel [N]:
    ``data[n] * scale[n]`` is row n."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


class Fp8Rows(NamedTuple):
    """Activations [M, K] in e4m3 and a float32 scale per row [M]; ``dtype``: the
    model dtype they were made from, a linear layer's output dtype."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape


#: A linear layer's weight: the model dtype's tensor, or FP8 with its scales.
Weight = torch.Tensor | Fp8Weight


def cache_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The K and V scales of a paged cache [blocks, Hkv, PAGE, D]: checked for an FP8
    cache, None for a cache of the model dtype. ValueError unless an FP8 cache, and only
    one, comes with float32 scales of [blocks, Hkv, PAGE], one layout for K and V (what
    ``qk_norm_rope`` writes and ``paged_attention`` reads)."""
    fp8 = k_cache.dtype == FP8
    if k_scale is None and v_scale is None and not fp8:
        return None
    if (not fp8 or k_scale is None or v_scale is None or k_scale.shape != k_cache.shape[:3]
            or v_scale.shape != k_scale.shape or v_scale.stride() != k_scale.stride()
            or k_scale.stride(-1) != 1 or k_scale.dtype != torch.float32
            or v_scale.dtype != torch.float32):
        raise ValueError("an FP8 cache, and only one, comes with float32 K and V scales of "
                         "[blocks, kv heads, page], one layout for both")
    return k_scale, v_scale


def quantize_weight(weight: torch.Tensor) -> Fp8Weight:
    """``weight`` [N, K] in e4m3 with a scale per output channel (torch, at load)."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(MIN_AMAX) * INV_FP8_MAX
    data = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(data, scale)


def dequantize(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight an FP8 one stands for, in ``dtype`` (the tests' reference)."""
    return (weight.data.float() * weight.scale[:, None]).to(dtype)


@triton.jit
def fp8_scale(amax):
    """The scale of values whose largest magnitude is ``amax``."""
    return tl.maximum(amax, _MIN_AMAX) * _INV_FP8_MAX


@triton.jit
def to_fp8(x, scale):
    """``x`` (float32) over ``scale``, correctly rounded, then to e4m3 (nearest even)."""
    return tl.div_rn(x, scale).to(tl.float8e4nv)


@triton.jit
def _quantize_rows_kernel(x_ptr, y_ptr, s_ptr, K, stride_x, stride_y, BLOCK: tl.constexpr,
                          PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    # One program a row: its amax in one pass, its e4m3 values in a second.
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = fp8_scale(tl.max(amax, axis=0))
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_x + k0 + cols, mask=k0 + cols < K, other=0.0)
        tl.store(y_ptr + row * stride_y + k0 + cols, to_fp8(x.to(tl.float32), scale),
                 mask=k0 + cols < K)
    tl.store(s_ptr + row, scale)


def quantize_rows(x: torch.Tensor) -> Fp8Rows:
    """``x`` [M, K] (the model dtype) in e4m3 with a scale per row."""
    m, k = x.shape
    if x.stride(-1) != 1:
        raise ValueError("rows of unit stride")
    y = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, y, scale, k, x.stride(0), y.stride(0),
                                    BLOCK=min(4096, triton.next_power_of_2(k)),
                                    **launch(x.device, (m,)), num_warps=4)
    return Fp8Rows(y, scale, x.dtype)
