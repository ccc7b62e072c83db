# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The linear layer: ``x @ weight.T`` (HF's weight layout) in a Triton GEMM, with the
epilogues a decoder layer needs fused in: SwiGLU over a gate_up projection
(``gated``), and the residual add (``residual``).

Batch-invariant (see ``dpu_frontend.model.layers``): each output element is
reduced over K in one order whatever the tile, so a row's bits never depend on
the number of rows. The MMA reduces K in 16-element steps, one after the other,
into one float32 accumulator per element: the tile's BLOCK_M, BLOCK_N and BLOCK_K,
its warps and stages change how many elements a program holds and how far it
loads ahead, not that order; nor does the way its blocks are loaded (by pointers,
or by the tensor-memory accelerator in a persistent grid, ``Tile.tma``). A split
of K (``SPLIT_K``), where a shape has one, is the shape's for every row count: its
splits are summed from zero each and added in split order, in one program or
spread over programs (``Tile.spread``). So the tile is chosen by the weight's
shape *and* the number of rows: few rows take narrow tiles that put enough
programs on the GPU to stream the weight at the bandwidth; many rows take tall
tiles that read the weight once for up to 256 rows. Every tile in the tables
gives the bits of ``REFERENCE_TILE``: ``benchmarks/linear_tiles.py`` keeps no
other, on the shapes it measured, and ``tests/gpu/test_linear.py`` holds each
Qwen3-0.6B and 8B shape's tiles to a row's bits alone at 1 to 512 rows.

With ``--quantization fp8`` the weight is FP8 with a scale per output channel and the
rows FP8 with a scale per row (``quant``): the same kernels multiply them on FP8
tensor cores, scale the float32 sums, then run the same epilogues, with tiles of
their own (``FP8_BUCKET_TILES``, ``FP8_LINEAR_TILES``) under the same rule.
"""

from __future__ import annotations

import bisect
from functools import cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from dpu_frontend.model.layers.activation import swiglu
from dpu_frontend.model.layers.pdl import dependent_start, launch, multiprocessors
from dpu_frontend.model.layers.quant import FP8, Fp8Rows, Fp8Weight, Weight, quantize_rows


def precision(dtype: torch.dtype) -> str:
    # float32 runs as float32 (the exactness tests); TF32 would not match.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _epilogue(acc, acc_up, r_ptr, xs_ptr, ws_ptr, rm, rn, M, N, mask, stride_rm,
              dtype: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
              SCALED: tl.constexpr):
    # Each step rounds where the unfused layers round: the projection to the output
    # dtype, then SwiGLU, then the residual add (in float32, rounded, as torch adds).
    # FP8 operands' float32 sums are first scaled by their row's and their channel's
    # scales (``quant``), in that order.
    if SCALED:
        xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)[:, None]
        acc = acc * xs * tl.load(ws_ptr + rn, mask=rn < N, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * xs * tl.load(ws_ptr + N + rn, mask=rn < N, other=0.0)[None, :]
    y = acc.to(dtype)
    if GATED:
        y = swiglu(y, acc_up.to(dtype))
    if RESIDUAL:
        r = tl.load(r_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0)
        y = (r.to(tl.float32) + y.to(tl.float32)).to(dtype)
    return y


@triton.jit
def _linear_kernel(x_ptr, w_ptr, y_ptr, r_ptr, p_ptr, xs_ptr, ws_ptr, M, N, K, K_SPLIT,
                   stride_xm, stride_wn, stride_ym, stride_rm, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                   SPREAD: tl.constexpr, PRECISION: tl.constexpr, GATED: tl.constexpr,
                   RESIDUAL: tl.constexpr, SCALED: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    # Row blocks vary fastest, then the K splits where they are SPREAD over programs: the
    # programs that share a block of the weight run side by side, so a weight read once
    # from memory serves them from L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m
    if SPREAD:
        pid_k = (pid // num_m) % SPLIT
        pid_n = pid // (num_m * SPLIT)
    else:
        pid_k = 0
        pid_n = pid // num_m
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    x_ptrs = x_ptr + rm[:, None] * stride_xm
    w_ptrs = w_ptr + rn[None, :] * stride_wn
    acc, acc_up = _split_sums(x_ptrs, w_ptrs, rm, rn, M, N, K, K_SPLIT, stride_wn, pid_k,
                              BLOCK_M, BLOCK_N, BLOCK_K, 1 if SPREAD else SPLIT, PRECISION,
                              GATED)
    if SPLIT == 1 or not SPREAD:
        y = _epilogue(acc, acc_up, r_ptr, xs_ptr, ws_ptr, rm, rn, M, N, mask, stride_rm,
                      y_ptr.dtype.element_ty, GATED, RESIDUAL, SCALED)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=mask)
    else:
        # This split's float32 sums, [SPLIT, M, N] (and the up half's after them), for
        # _split_sum_kernel to add in split order.
        part = p_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
        tl.store(part, acc, mask=mask)
        if GATED:
            tl.store(part + SPLIT * M * N, acc_up, mask=mask)


@triton.jit
def _split_sums(x_ptrs, w_ptrs, rm, rn, M, N, K, K_SPLIT, stride_wn, first,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                PARTS: tl.constexpr, PRECISION: tl.constexpr, GATED: tl.constexpr):
    # The sums over K splits first.. first + PARTS - 1, each from zero in the MMA's order,
    # added in split order: the float32 additions _split_sum_kernel makes of the same
    # splits spread over programs, so a shape's bits are one whichever way it runs.
    rk = tl.arange(0, BLOCK_K)
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for part in tl.static_range(PARTS):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The up half's accumulator (rows N.. of a gated weight); unused otherwise.
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_begin = (first + part) * K_SPLIT
        for k0 in range(k_begin, k_begin + K_SPLIT, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_ptrs + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptrs + kk[:, None], mask=(rn[None, :] < N) & (kk[:, None] < K),
                        other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            if GATED:
                u = tl.load(w_ptrs + N * stride_wn + kk[:, None],
                            mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0)
                acc_up = tl.dot(x, u, acc_up, input_precision=PRECISION)
        if part == 0:
            total, total_up = acc, acc_up
        else:
            total, total_up = total + acc, total_up + acc_up
    return total, total_up


@triton.jit
def _linear_tma_kernel(x_desc, w_desc, y_ptr, r_ptr, xs_ptr, ws_ptr, M, N, K, K_SPLIT,
                       stride_ym, stride_rm, PROGRAMS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                       PRECISION: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                       SCALED: tl.constexpr, WS: tl.constexpr, PDL: tl.constexpr,
                       EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    # _linear_kernel's sums, its K splits in one program, with the blocks brought in by
    # the tensor-memory accelerator (zero past the operands' edges, as the masked loads),
    # in a persistent grid of PROGRAMS (one a multiprocessor) that walk the output tiles
    # row blocks fastest. A gated weight is read as [2, N, K]: one load brings a block's
    # gate rows and its up rows, and one MMA twice as wide sums both ([gate | up] columns
    # of the accumulator). WS: the loop warp-specialized (Triton's partition of the TMA
    # loads and the MMAs into warps of their own), its tiles' loops kept apart.
    WIDTH: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    FLATTEN: tl.constexpr = not WS
    num_m = tl.cdiv(M, BLOCK_M)
    tiles = num_m * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, PROGRAMS, flatten=FLATTEN,
                         warp_specialize=WS):
        pid_m = tile % num_m
        pid_n = tile // num_m
        total = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
        for part in tl.static_range(SPLIT):
            acc = tl.zeros((BLOCK_M, WIDTH), dtype=tl.float32)
            for k0 in range(part * K_SPLIT, (part + 1) * K_SPLIT, BLOCK_K):
                x = x_desc.load([pid_m * BLOCK_M, k0])
                if GATED:
                    w = w_desc.load([0, pid_n * BLOCK_N, k0]).reshape(WIDTH, BLOCK_K)
                else:
                    w = w_desc.load([pid_n * BLOCK_N, k0])
                acc = tl.dot(x, w.T, acc, input_precision=PRECISION)
            total = acc if part == 0 else total + acc
        if GATED:
            gate, up = total.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1).split()
        else:
            gate, up = total, total
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        y = _epilogue(gate, up, r_ptr, xs_ptr, ws_ptr, rm, rn, M, N, mask, stride_rm,
                      y_ptr.dtype.element_ty, GATED, RESIDUAL, SCALED)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=mask)


@triton.jit
def _split_sum_kernel(p_ptr, y_ptr, r_ptr, xs_ptr, ws_ptr, M, N, stride_ym, stride_rm,
                      SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      GATED: tl.constexpr, RESIDUAL: tl.constexpr, SCALED: tl.constexpr,
                      PDL: tl.constexpr, EARLY: tl.constexpr):
    dependent_start(PDL, EARLY)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    part = p_ptr + rm[:, None] * N + rn[None, :]
    # Split 0, then 1, then 2...: one order, whatever the rows.
    acc = tl.load(part, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part + s * M * N, mask=mask, other=0.0)
    acc_up = acc
    if GATED:
        acc_up = tl.load(part + SPLIT * M * N, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc_up += tl.load(part + (SPLIT + s) * M * N, mask=mask, other=0.0)
    y = _epilogue(acc, acc_up, r_ptr, xs_ptr, ws_ptr, rm, rn, M, N, mask, stride_rm,
                  y_ptr.dtype.element_ty, GATED, RESIDUAL, SCALED)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], y, mask=mask)


class Tile(NamedTuple):
    """A linear's tile: the output block a program computes, the K step, warps and
    pipeline stages. ``tma``: loaded by the tensor-memory accelerator in a persistent
    grid (``_linear_tma_kernel``; Hopper on), else by pointers, a program per block.
    ``spread``: a shape's K splits (``SPLIT_K``) run in programs of their own, their
    float32 sums added by a second kernel (pointers only), else one after the other in
    one program. ``ws``: a TMA tile's loop warp-specialized (loads and MMAs in warps of
    their own, as cuBLAS's Hopper kernels run them; ``benchmarks.linear_tiles``'
    candidates, in no table yet). None changes a bit."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    tma: bool = False
    spread: bool = False
    ws: bool = False

    def __str__(self) -> str:
        return ("x".join(map(str, self[:5])) + ("t" if self.tma else "") + ("w" if self.ws else "")
                + ("s" if self.spread else ""))


#: The tile whose bits every other tile reproduces (the engine's one tile until issue 24).
REFERENCE_TILE: Tile = Tile(64, 64, 64, 4, 4)
#: The row-count buckets: a tile serves M <= M_BUCKETS[i]; the last one, any M above.
M_BUCKETS: tuple[int, ...] = (16, 64, 128, 256)
#: One tile per bucket, for weight shapes without a row of their own: the tiles with the
#: best geometric mean over the 15 linears of Qwen3-0.6B, 8B and 32B (H100, 2026-11-27).
BUCKET_TILES: tuple[Tile, ...] = (
    Tile(16, 32, 256, 4, 4),  # 1-16 rows: 16-row MMAs, narrow and deep, to fill the GPU
    Tile(64, 32, 128, 4, 5),
    Tile(64, 64, 64, 4, 4),
    Tile(64, 64, 64, 4, 4),
    Tile(128, 128, 64, 8, 4),  # past 256 rows: the weight read once per 128 rows
)
#: Tiles by weight shape (N, K) for 16-bit inputs, one per bucket, where a shape's best
#: beats the bucket's tile by 3% or more (the comment: the model and linear measured, and
#: the gain per bucket over the tile it replaced). A gate_up row is measured gated (the
#: model's call). The table is keyed by shape alone, whichever model has it.
#: benchmarks/linear_tiles.py measures the candidates and keeps only those bit for bit
#: the reference's; H100, 2026-11-27 (docs/gpu.md, "Linear tiles by row count", and
#: for the last three buckets of Qwen3-8B and 32B, "Issue 24, second step").
LINEAR_TILES: dict[tuple[int, int], tuple[Tile, ...]] = {
    # Qwen3-0.6B o_proj, down (1.5x past 256 rows)
    (1024, 2048): (*BUCKET_TILES[:4], Tile(64, 64, 64, 4, 4)),
    (1024, 3072): (*BUCKET_TILES[:4], Tile(64, 64, 64, 4, 4)),
    # Qwen3-0.6B lm_head: 1.23, 1.07, 1.48, 1.26x from the second bucket on
    (151936, 1024): (Tile(16, 32, 256, 4, 4), Tile(64, 64, 128, 4, 3), Tile(128, 64, 64, 4, 4),
                     Tile(128, 256, 64, 8, 4), Tile(128, 256, 64, 8, 3)),
    # Qwen3-8B qkv: 1.13x (17-64 rows); 1.17, 1.09, 1.22x past 64
    (6144, 4096): (Tile(16, 32, 256, 4, 4), Tile(64, 64, 128, 4, 5), Tile(128, 64, 128, 4, 4),
                   Tile(128, 128, 128, 8, 3, tma=True), Tile(128, 256, 64, 8, 3, tma=True)),
    # Qwen3-8B o_proj: 1.41, 1.24, 1.10x past 64 rows
    (4096, 4096): (*BUCKET_TILES[:2], Tile(64, 64, 128, 4, 5), Tile(64, 128, 128, 4, 4),
                   Tile(128, 128, 64, 8, 4, tma=True)),
    # Qwen3-8B gate_up: 1.03, 1.22, 1.22x past 64 rows (gate and up in one TMA load)
    (24576, 4096): (Tile(16, 32, 256, 4, 4), Tile(64, 32, 128, 4, 5),
                    Tile(64, 64, 128, 4, 4, tma=True), Tile(128, 64, 128, 8, 3, tma=True),
                    Tile(128, 128, 64, 8, 4, tma=True)),
    # Qwen3-8B down: 1.51, 1.24, 1.14x past 64 rows
    (4096, 12288): (*BUCKET_TILES[:2], Tile(64, 64, 128, 4, 5), Tile(64, 128, 128, 4, 4),
                    Tile(128, 128, 64, 8, 4, tma=True)),
    # Qwen3-8B lm_head: 1.12x (17-64), then 1.03, 1.11, 1.07x
    (151936, 4096): (Tile(16, 32, 256, 4, 4), Tile(64, 128, 128, 4, 3),
                     Tile(128, 128, 64, 8, 4, tma=True), Tile(128, 256, 64, 8, 4),
                     Tile(256, 128, 64, 8, 3, tma=True)),
    # Qwen3-32B qkv: 1.06, 1.12, 1.0x to 128 rows; 1.13, 1.14x past
    (10240, 5120): (Tile(16, 64, 128, 4, 4), Tile(64, 64, 128, 4, 3), Tile(64, 64, 64, 4, 4),
                    Tile(128, 256, 64, 8, 3, tma=True), Tile(128, 128, 64, 8, 4, tma=True)),
    # Qwen3-32B o_proj: 1.3x (17-64); 1.26, 1.15, 1.31x past 64
    (5120, 8192): (Tile(16, 32, 256, 4, 4), Tile(64, 64, 128, 4, 5), Tile(128, 64, 128, 4, 4),
                   Tile(128, 128, 64, 8, 4, tma=True), Tile(128, 256, 64, 8, 3, tma=True)),
    # Qwen3-32B gate_up: 1.09x (65-128); 1.17, 1.16x past 128 rows (one TMA load)
    (51200, 5120): (Tile(16, 32, 256, 4, 4), Tile(64, 32, 128, 4, 5), Tile(128, 128, 64, 8, 4),
                    Tile(64, 64, 128, 4, 4, tma=True), Tile(128, 128, 64, 8, 3, tma=True)),
    # Qwen3-32B down: 1.34x (17-64); 1.28, 1.11, 1.36x past 64
    (5120, 25600): (Tile(16, 32, 256, 4, 4), Tile(64, 64, 128, 4, 5), Tile(128, 64, 128, 4, 4),
                    Tile(128, 128, 128, 8, 3, tma=True), Tile(128, 256, 64, 8, 3, tma=True)),
    # Qwen3-32B lm_head: 1.18x (17-64), then 1.03, 1.06, 1.06x
    (151936, 5120): (Tile(16, 32, 256, 4, 4), Tile(64, 128, 128, 4, 3),
                     Tile(128, 128, 64, 8, 4, tma=True), Tile(256, 128, 64, 8, 3, tma=True),
                     Tile(128, 128, 64, 8, 4, tma=True)),
}
FLOAT32_TILE: Tile = Tile(32, 64, 32, 4, 3)
#: FP8 operands (``--quantization fp8``): their reference tile, one tile per bucket, and
#: tiles by shape as ``LINEAR_TILES``. Every FP8 tile is 64 rows or more with warps in
#: fours, so that the MMA is Hopper's warpgroup MMA at every row count: it accumulates
#: K in 32-element steps into the float32 accumulator, each element's steps in K order
#: whatever the tile. (A 16-row tile runs the older MMA, whose FP8 sums differ in the
#: last bits: measured on the H100, docs/gpu.md.) Like vLLM's FP8 GEMMs, the MMA
#: accumulates at its own precision ("fast accumulation"): promoting the sums to
#: float32 every 128 elements halved the error against float32 sums (to 2.5e-3 of the
#: largest output) and cost 5-25% at 1-256 rows. The tiles are 256 bytes deep in K
#: (a 16-bit tile's 128) up to 256 rows. Swept on the H100 over Qwen3-8B's layers
#: (``linear_tiles --fp8``, 2026-11-28, docs/gpu.md, "Issue 24, third step"); every candidate was
#: bit for bit the reference's.
FP8_REFERENCE_TILE: Tile = Tile(64, 64, 128, 4, 4)
FP8_BUCKET_TILES: tuple[Tile, ...] = (
    Tile(64, 32, 256, 4, 5),
    Tile(64, 32, 256, 4, 5),
    Tile(64, 64, 256, 4, 4),
    Tile(128, 128, 128, 8, 4),  # fits a gated weight's two blocks in shared memory
    Tile(128, 128, 128, 8, 4, tma=True),
)
FP8_LINEAR_TILES: dict[tuple[int, int], tuple[Tile, ...]] = {
    # Qwen3-8B qkv: 1.23, 1.23, 1.31x to 128 rows, 1.17x past 256
    (6144, 4096): (Tile(64, 64, 256, 4, 5), Tile(64, 64, 256, 4, 5), Tile(64, 128, 256, 4, 4),
                   FP8_BUCKET_TILES[3], Tile(64, 128, 128, 4, 3)),
    # Qwen3-8B o_proj and down: 1.30 and 1.37x at 129-256 rows
    (4096, 4096): (*FP8_BUCKET_TILES[:3], Tile(64, 128, 256, 4, 4), FP8_BUCKET_TILES[4]),
    (4096, 12288): (*FP8_BUCKET_TILES[:3], Tile(64, 128, 256, 4, 4), FP8_BUCKET_TILES[4]),
    # Qwen3-8B gate_up: 1.06, 1.08, 1.15, 1.07x to 256 rows
    (24576, 4096): (Tile(64, 32, 128, 4, 3), Tile(64, 32, 256, 4, 4, tma=True),
                    Tile(64, 64, 128, 4, 3), FP8_BUCKET_TILES[4], FP8_BUCKET_TILES[4]),
}
#: K splits by weight shape (default 1), for every row count alike: a shape whose few
#: output columns leave the GPU's multiprocessors idle, or its L2 busy with re-reads,
#: at hundreds of rows. Each split sums its K range in the MMA's order; the splits are
#: then added in split order, by the program itself or, for a spread tile, by a second
#: kernel. The bits are the shape's, whatever the rows. Empty: on the H100
#: (2026-11-27), over Qwen3-8B's linears at 16-512 rows, two splits (in a program or
#: spread) beat one only for down at 256 rows, by 2.6%, where a tile 128 deep in K then
#: beat both by 12% (docs/gpu.md, "Issue 24, second step").
SPLIT_K: dict[tuple[int, int], int] = {}


def bucket(m: int) -> int:
    """The index of the row-count bucket holding ``m`` rows."""
    return bisect.bisect_left(M_BUCKETS, m)


def linear_tile(n: int, k: int, dtype: torch.dtype, m: int) -> Tile:
    """The tile of a weight [N, K] over ``m`` rows of ``dtype``: by shape and row count.
    Float32 (the exactness tests against transformers) has one tile; FP8 operands have
    tables of their own."""
    if dtype == torch.float32:
        return FLOAT32_TILE
    if dtype == FP8:
        return FP8_LINEAR_TILES.get((n, k), FP8_BUCKET_TILES)[bucket(m)]
    return LINEAR_TILES.get((n, k), BUCKET_TILES)[bucket(m)]


def split_fits(k: int, splits: int, block_k: int) -> bool:
    """Whether ``splits`` cut K into whole ``block_k``-wide blocks; one split always fits
    (its tail is masked)."""
    return splits == 1 or (k % splits == 0 and (k // splits) % block_k == 0)


def linear_split(n: int, k: int, dtype: torch.dtype) -> int:
    """The K splits of a weight [N, K] with inputs of ``dtype``: by shape alone."""
    return 1 if dtype in (torch.float32, FP8) else SPLIT_K.get((n, k), 1)


def _check(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, gated: bool,
           residual: torch.Tensor | None, split: int | None) -> None:
    """ValueError for operands the kernel would read wrongly: it takes rows of unit
    stride, a weight of the input's width, and a residual of the output's shape and
    dtype (the sum is rounded to it)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x of {tuple(x.shape)} against a weight of {tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and the weight must have rows of unit stride")
    if gated and (weight.shape[0] % 2 or residual is not None):
        raise ValueError("a gated weight has an even number of rows (gate, then up) and "
                         "takes no residual")
    if residual is not None and (residual.shape != y.shape or residual.dtype != y.dtype
                                 or residual.stride(-1) != 1):
        raise ValueError(f"a residual of {tuple(residual.shape)} {residual.dtype} for an "
                         f"output of {tuple(y.shape)} {y.dtype}, rows of unit stride")
    if split is not None and split < 1:
        raise ValueError(f"{split} K splits: one or more")
    if (x.dtype == FP8) != (weight.dtype == FP8):
        raise ValueError(f"x of {x.dtype} against a weight of {weight.dtype}: FP8 takes both")


def _operands(x: torch.Tensor | Fp8Rows, weight: Weight
              ) -> tuple[torch.Tensor, torch.Tensor, torch.dtype, torch.Tensor | None,
                         torch.Tensor | None]:
    """The kernel's x and weight, the output's default dtype, and the FP8 operands'
    scales (rows, channels): rows of the model dtype entering an FP8 weight are
    quantized here (``quant.quantize_rows``)."""
    if isinstance(weight, Fp8Weight):
        rows = x if isinstance(x, Fp8Rows) else quantize_rows(x)
        for data, scale in ((rows.data, rows.scale), (weight.data, weight.scale)):
            if (scale.shape != data.shape[:1] or scale.dtype != torch.float32
                    or scale.stride(0) != 1 or scale.device != data.device):
                raise ValueError("an FP8 operand has a float32 scale per row, beside it")
        if rows.dtype == FP8:
            raise ValueError("FP8 rows stand for rows of a 16-bit model dtype")
        return rows.data, weight.data, rows.dtype, rows.scale, weight.scale
    if isinstance(x, Fp8Rows):
        raise ValueError("FP8 rows are multiplied by an FP8 weight")
    return x, weight, x.dtype, None, None


def linear(x: torch.Tensor | Fp8Rows, weight: Weight, out_dtype: torch.dtype | None = None,
           *, gated: bool = False, residual: torch.Tensor | None = None,
           tile: Tile | None = None, split: int | None = None) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` [M, K] and ``weight`` [N, K] (HF's layout).

    ``gated``: ``weight`` is a gate_up projection [gate | up] of [2I, K], and the result
    is SwiGLU's ``silu(gate) * up``, [M, I] (``activation.silu_mul`` of the plain
    product, bit for bit). ``residual`` [M, N]: the result is ``residual + x @ weight.T``,
    rounded as torch rounds the sum. An FP8 weight (``quant.Fp8Weight``) multiplies FP8
    rows (``x`` as ``quant.Fp8Rows``, or quantized here), on FP8 tensor cores; the
    float32 sums are scaled back before the epilogue, and the output is the rows' model
    dtype. ``tile`` and ``split`` override the tables' (the benchmark)."""
    x, w, dtype, x_scale, w_scale = _operands(x, weight)
    m, k = x.shape
    n = w.shape[0] // 2 if gated else w.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or dtype, device=x.device)
    _check(x, w, y, gated, residual, split)
    if m == 0:
        return y
    if y.dtype == FP8:
        raise ValueError("a linear's output is the model dtype or float32, not FP8")
    tile = Tile(*tile) if tile else linear_tile(w.shape[0], k, x.dtype, m)
    if x.dtype == FP8 and (tile.block_m < 64 or tile.warps % 4):
        # A smaller tile runs another MMA, whose FP8 sums have other bits.
        raise ValueError(f"FP8 tile {tile}: 64 rows or more, warps in fours")
    splits = split or linear_split(w.shape[0], k, x.dtype)
    if not split_fits(k, splits, tile.block_k):
        raise ValueError(f"K {k} in {splits} splits is not a whole number of "
                         f"{tile.block_k}-wide blocks")
    r = residual if residual is not None else y
    # The scales' pointers, unused unless SCALED: any tensor.
    xs, ws = (x_scale, w_scale) if x_scale is not None and w_scale is not None else (y, y)
    flags = {"GATED": gated, "RESIDUAL": residual is not None, "SCALED": x_scale is not None}
    spread = tile.spread and splits > 1
    if tile.tma and not spread and tma_fits(x, w):
        _linear_tma(x, w, y, r, xs, ws, tile, splits, flags)
        return y
    # The pointer kernel, for spread splits and for operands the TMA cannot take: the same
    # tile, the same bits.
    bm, bn, bk, warps, stages = tile[:5]
    # Partial sums of spread splits, float32: [SPLIT, M, N], twice over when gated.
    part = (torch.empty(((2 if gated else 1) * splits, m, n), dtype=torch.float32,
                        device=x.device) if spread else y)
    grid = (triton.cdiv(m, bm) * (splits if spread else 1) * triton.cdiv(n, bn),)
    _linear_kernel[grid](x, w, y, r, part, xs, ws, m, n, k, k // splits, x.stride(0),
                         w.stride(0), y.stride(0), r.stride(0), BLOCK_M=bm, BLOCK_N=bn,
                         BLOCK_K=bk, SPLIT=splits, SPREAD=spread,
                         PRECISION=precision(x.dtype), **flags, **launch(x.device, grid),
                         num_warps=warps, num_stages=stages)
    if spread:
        sum_m, sum_n = 4, 256
        sums = (triton.cdiv(n, sum_n), triton.cdiv(m, sum_m))
        _split_sum_kernel[sums](
            part, y, r, xs, ws, m, n, y.stride(0), r.stride(0), SPLIT=splits, BLOCK_M=sum_m,
            BLOCK_N=sum_n, **flags, **launch(x.device, sums), num_warps=4)
    return y


@cache
def has_tma(device: int) -> bool:
    """An NVIDIA GPU of compute capability 9 (Hopper) or later."""
    return torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


def tma_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the tensor-memory accelerator can read these operands: a Hopper GPU or
    later, 16-bit or FP8 elements, 16-byte aligned bases and row strides, rows that do
    not overlap."""
    return (x.is_cuda and has_tma(x.device.index or 0)
            and x.dtype in (torch.bfloat16, torch.float16, FP8) and weight.dtype == x.dtype
            and all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
                    and t.stride(0) >= t.shape[1] for t in (x, weight)))


def _linear_tma(x: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, r: torch.Tensor,
                xs: torch.Tensor, ws: torch.Tensor, tile: Tile, splits: int,
                flags: dict[str, bool]) -> None:
    m, k = x.shape
    n = y.shape[1]
    bm, bn, bk, warps, stages = tile[:5]
    # One program a multiprocessor whatever the rows (those past the tiles exit at once):
    # the grid's size is a constant of the kernel, compiled once a tile, not once for
    # each row count under a full grid.
    programs = multiprocessors(x.device.index or 0)
    # The descriptors are built on the host and passed by value: a captured graph keeps
    # them, with the operands' addresses, as it keeps pointers.
    x_desc = TensorDescriptor(x, [m, k], [x.stride(0), 1], [bm, bk])
    row = weight.stride(0)
    w_desc = (TensorDescriptor(weight, [2, n, k], [n * row, row, 1], [2, bn, bk])
              if flags["GATED"] else TensorDescriptor(weight, [n, k], [row, 1], [bn, bk]))
    _linear_tma_kernel[(programs,)](x_desc, w_desc, y, r, xs, ws, m, n, k, k // splits,
                                    y.stride(0), r.stride(0), PROGRAMS=programs, BLOCK_M=bm,
                                    BLOCK_N=bn, BLOCK_K=bk, SPLIT=splits,
                                    PRECISION=precision(x.dtype), **flags, WS=tile.ws,
                                    **launch(x.device, (programs,), persistent=True),
                                    num_warps=warps, num_stages=stages)
