# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The linear layer: ``x @ weight.T`` (HF's weight layout) in a Triton GEMM.

Batch-invariant (see ``dpu_frontend.model.layers``): each output element is
reduced over K in one fixed order, set by a tile chosen by the weight's shape
and the dtype, never by the number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def precision(dtype: torch.dtype) -> str:
    # float32 runs as float32 (the exactness tests); TF32 would not match.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(0)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + kk[:, None],
                    mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


#: A linear's tile: BLOCK_M, BLOCK_N, BLOCK_K, warps, pipeline stages.
Tile = tuple[int, int, int, int, int]
#: Tiles by weight shape (N, K) for 16-bit inputs; others get ``DEFAULT_TILE``.
#: benchmarks/linear_tiles.py measures the candidates; only tiles whose output is
#: bit for bit the default's are taken, so a tile changes speed, never a token.
#: The table is keyed by shape alone, whichever model has it: a shape measured once
#: serves every model that has it. Measured on an H200 (docs/gpu.md, "Linear tiles"):
#: narrower, deeper tiles for projections back to a hidden size of 1,024, whose N
#: gives the default tile too few programs to fill the GPU.
LINEAR_TILES: dict[tuple[int, int], Tile] = {
    (1024, 2048): (64, 32, 128, 4, 3),  # attention output: 16 heads of 128 -> 1,024
    (1024, 3072): (64, 32, 128, 4, 4),  # MLP down: 3,072 -> 1,024
    # An output head of 151,936 rows over a step's sampled rows: 128-row tiles read its
    # 311 MB weight half as often at large batches (H100, 256 rows: 280 against 480 us;
    # 1 row: 112 against 107 us).
    (151936, 1024): (128, 64, 64, 4, 3),
}
DEFAULT_TILE: Tile = (64, 64, 64, 4, 4)
FLOAT32_TILE: Tile = (32, 64, 32, 4, 3)


def linear_tile(n: int, k: int, dtype: torch.dtype) -> Tile:
    """The tile of a weight [N, K] with inputs of ``dtype``: by shape, never by batch."""
    if dtype == torch.float32:
        return FLOAT32_TILE
    return LINEAR_TILES.get((n, k), DEFAULT_TILE)


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None, *,
           tile: Tile | None = None) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` [M, K] and ``weight`` [N, K] (HF's layout); ``tile``
    overrides the shape's own (the tile benchmark)."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk, warps, stages = tile or linear_tile(n, k, x.dtype)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm))
    _linear_kernel[grid](x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=precision(x.dtype),
                         num_warps=warps, num_stages=stages)
    return y


