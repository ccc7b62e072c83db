# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""RMSNorm, one program per row (so a row's result never depends on the batch)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    y = rms_normalize(x, w, N, eps)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


#: The norm kernel's warps: the fused q/k norm (rope.py) runs its rows with as many, for
#: the same reduction order.
NORM_WARPS = 4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, one program per row."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, y, n, rows.stride(0), y.stride(0), eps,
                                           BLOCK=triton.next_power_of_2(n), num_warps=NORM_WARPS)
    return y.view(x.shape)


