# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""RMSNorm, one program per row (so a row's result never depends on the batch); with
``--quantization fp8``, the normed row is also quantized for the next linear layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dpu_frontend.model.layers.pdl import dependent_start, launch
from dpu_frontend.model.layers.quant import FP8, Fp8Rows, fp8_scale, to_fp8


@triton.jit
def rms_normalize(x, w, N, eps):
    """One row ``x`` (float32, masked lanes 0) normalized and scaled by ``w``, as HF's
    Llama-family RMSNorm: normalize in float32, round to the weight's dtype, then
    multiply by the weight in that dtype; float32, for the caller to round. One
    definition for this kernel and the fused q/k norm (rope.py): a row of the same
    block shape and warps is reduced in the same order, so both give the same bits."""
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    return (x * rstd).to(w.dtype).to(tl.float32) * w.to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, s_ptr, N, stride_x, stride_y, eps,
                     BLOCK: tl.constexpr, FP8_OUT: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    y = rms_normalize(x.to(tl.float32), w, N, eps).to(x.dtype)
    if FP8_OUT:
        # The row rms_norm gives, quantized as quant.quantize_rows quantizes it.
        y = y.to(tl.float32)
        scale = fp8_scale(tl.max(tl.abs(y), axis=0))
        tl.store(y_ptr + row * stride_y + cols, to_fp8(y, scale), mask=cols < N)
        tl.store(s_ptr + row, scale)
    else:
        tl.store(y_ptr + row * stride_y + cols, y, mask=cols < N)


#: The norm kernel's warps: the fused q/k norm (rope.py) runs its rows with as many, for
#: the same reduction order.
NORM_WARPS = 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, one program per row."""
    rows = _rows(x)
    y = torch.empty_like(rows)
    _launch(rows, weight, y, y, eps)
    return y.view(x.shape)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Fp8Rows:
    """``rms_norm`` of the rows of ``x`` [M, N], in e4m3 with a scale per row: bit for
    bit ``quantize_rows(rms_norm(x, weight, eps))``, in one launch."""
    rows = _rows(x)
    y = torch.empty(rows.shape, dtype=FP8, device=x.device)
    scale = torch.empty((rows.shape[0],), dtype=torch.float32, device=x.device)
    _launch(rows, weight, y, scale, eps)
    return Fp8Rows(y, scale, x.dtype)


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _launch(rows: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, scale: torch.Tensor,
            eps: float) -> None:
    m, n = rows.shape
    if m:
        _rms_norm_kernel[(m,)](rows, weight, y, scale, n, rows.stride(0), y.stride(0), eps,
                               BLOCK=triton.next_power_of_2(n), FP8_OUT=y.dtype == FP8,
                               **launch(rows.device, (m,)), num_warps=NORM_WARPS)


