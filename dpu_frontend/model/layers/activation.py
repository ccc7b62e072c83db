# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The gated MLP's activation: SwiGLU's ``silu(gate) * up``, elementwise.

The model runs it inside the gate_up projection's epilogue (``linear(...,
gated=True)``); this kernel is the unfused form the tests hold that to."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dpu_frontend.model.layers.pdl import dependent_start, launch


@triton.jit
def swiglu(gate, up):
    """``silu(gate) * up`` of two tensors of the model's dtype, rounded as torch rounds
    it: silu in float32 rounded to the dtype, then the product rounded. One definition
    for this kernel and the linear layer's gated epilogue, so both give the same bits."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, N, stride_x, stride_y, BLOCK: tl.constexpr,
                     PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    tl.store(y_ptr + row * stride_y + cols, swiglu(gate, up), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` for ``x`` = [gate | up] of [T, 2I]."""
    t, n2 = x.shape
    n = n2 // 2
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = 1024
        grid = (t, triton.cdiv(n, block))
        _silu_mul_kernel[grid](x, y, n, x.stride(0), y.stride(0), BLOCK=block,
                               **launch(x.device, grid), num_warps=4)
    return y
