# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""A mixture-of-experts MLP (Qwen3-MoE's), on the GPU from the router to the sum:

1. ``route``: the router's logits (a ``linear``) to each token's top-k experts and
   their weights: softmax in float32, the k largest one by one, renormalized to sum
   to 1 where the config says (``norm_topk_prob``), the weights rounded to the model
   dtype as transformers rounds them;
2. ``group_by_expert``: the (token, k) pairs sorted by expert, each expert's run padded
   to whole blocks of rows (three short launches of a chunk of pairs a program; no
   host sync: CUDA graphs capture it);
3. ``moe_gemm``, once a projection: each program takes one block of one
   expert's pairs and a block of its output columns. The gate_up projection gathers
   the tokens' rows and ends in SwiGLU (``activation.swiglu``); down reads those rows;
4. ``_moe_combine_kernel``: each token's experts weighted and summed in ascending
   expert id, then the residual added.

**Batch invariance.** A pair's row of an expert's product is summed over K in steps
fixed by the shape (no split-K), in a tile whose other rows are other tokens': as
for ``linear``, the row's bits do not depend on them. A token's experts are summed
in one order, its experts' ids, whatever else is in the batch.

**Rounding** follows transformers' ``Qwen3MoeSparseMoeBlock`` with its eager experts
(the loop over the experts with ``index_add_``; ``_experts_implementation = "eager"``):
each expert's output and its product with the (model-dtype) weight are rounded to the
model dtype, and added in the model dtype, expert after expert in ascending id; the
residual is added after, in the model dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dpu_frontend.model.layers.activation import swiglu
from dpu_frontend.model.layers.linear import precision
from dpu_frontend.model.layers.pdl import dependent_start, launch


class MoeTile(NamedTuple):
    """A grouped-GEMM program's rows (one expert's pairs; the grouping pads each
    expert's run to them), output columns, warps and pipeline stages. None of these
    is part of a row's bits: its sum over K runs in ``MOE_BLOCK_K`` steps whatever
    the tile (``benchmarks.moe_tiles`` checks each candidate's bits against this
    one's)."""

    block_m: int
    block_n: int
    warps: int
    stages: int

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n}w{self.warps}s{self.stages}"


#: The K step: part of a row's bits, fixed whatever the batch.
MOE_BLOCK_K = 64
#: The reference tile (``benchmarks.moe_tiles`` holds every candidate's bits to its).
MOE_TILE = MoeTile(block_m=16, block_n=64, warps=4, stages=3)
MOE_BLOCK_M = MOE_TILE.block_m
#: The (gate_up, down) tiles, by the pairs an expert gets on average. Few (decode's
#: small batches): 16 rows, narrow column blocks and deep pipelines, to put enough
#: programs on the GPU to stream the experts. Many (from ``MOE_MANY_PAIRS``): 64 rows,
#: so that an expert's weights are read once for all its pairs. Lots (from
#: ``MOE_LOTS_PAIRS``, prompt chunks of thousands of tokens): 128 x 128 tiles, whose
#: products, not the weights' bytes, are the time. Chosen from ``benchmarks.moe_tiles``
#: on an H200 (docs/gpu.md): at Qwen3-30B-A3B's shapes, 1 to 2,048 tokens, every
#: candidate's bits equal the reference's.
MOE_TILES_FEW = (MoeTile(16, 32, 4, 5), MoeTile(16, 64, 4, 5))
MOE_TILES_MANY = (MoeTile(64, 64, 4, 3), MoeTile(64, 128, 8, 4))
MOE_TILES_LOTS = (MoeTile(128, 128, 8, 4), MoeTile(128, 128, 8, 3))
MOE_MANY_PAIRS = 8
MOE_LOTS_PAIRS = 128


def moe_tiles(pairs: int, experts: int) -> tuple[MoeTile, MoeTile]:
    """The (gate_up, down) tiles for ``pairs`` (token, expert) pairs over ``experts``:
    one grouping serves both, so their rows are one."""
    if pairs >= MOE_LOTS_PAIRS * experts:
        return MOE_TILES_LOTS
    return MOE_TILES_MANY if pairs >= MOE_MANY_PAIRS * experts else MOE_TILES_FEW
COMBINE_BLOCK = 512


@triton.jit
def _route_kernel(logits_ptr, ids_ptr, w_ptr, E, stride_l, TOP_K: tl.constexpr,
                  K_P2: tl.constexpr, BLOCK_E: tl.constexpr, NORM: tl.constexpr,
                  PDL: tl.constexpr, EARLY: tl.constexpr):
    """One token: softmax over its experts' logits, the top k (the largest first; among
    equal probabilities the lowest id), their weights renormalized where NORM."""
    dependent_start(PDL, EARLY)
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = p / tl.sum(p, axis=0)
    k = tl.arange(0, K_P2)
    ids = tl.zeros((K_P2,), dtype=tl.int32)
    top = tl.zeros((K_P2,), dtype=tl.float32)
    # A row of NaN or infinite logits (nothing a model should make) still picks k
    # distinct ids below E, its weights NaN: the fault stays in its own row.
    left = tl.where(e < E, tl.where(p == p, p, 0.0), -1.0)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, e, BLOCK_E), axis=0)
        ids = tl.where(k == j, pick, ids)
        top = tl.where(k == j, best, top)
        left = tl.where(e == pick, -1.0, left)
    if NORM:
        top = top / tl.sum(top, axis=0)
    live = k < TOP_K
    tl.store(ids_ptr + t * TOP_K + k, ids, mask=live)
    tl.store(w_ptr + t * TOP_K + k, top.to(w_ptr.dtype.element_ty), mask=live)


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """Each token's ``top_k`` experts [T, k] int32 (by probability, largest first) and
    their weights [T, k] in the logits' dtype, from the router's logits [T, experts]."""
    t, experts = logits.shape
    ids = torch.empty((t, top_k), dtype=torch.int32, device=logits.device)
    weights = torch.empty((t, top_k), dtype=logits.dtype, device=logits.device)
    if t:
        _route_kernel[(t,)](logits, ids, weights, experts, logits.stride(0), TOP_K=top_k,
                            K_P2=triton.next_power_of_2(top_k),
                            BLOCK_E=triton.next_power_of_2(experts), NORM=norm_topk_prob,
                            **launch(logits.device, (t,)), num_warps=4)
    return ids, weights


def group_by_expert(ids: torch.Tensor, num_experts: int,
                    block_m: int = MOE_BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, k) pairs of ``ids`` [T, k] grouped by expert, for the grouped GEMM:

    - ``pairs``: pair indices (``token * k + slot``), each expert's run starting on a
      block of ``block_m``, in the pairs' order, and padded with T * k;
    - ``block_expert``: each block's expert, ``num_experts`` past the last run.

    Sizes depend on T and k alone (at most ``cdiv(T k, block_m) + min(experts, T k)``
    blocks), and nothing waits for the GPU, so a CUDA graph captures it. Three short
    launches spread the work over programs of ``GROUP_CHUNK`` pairs (``_group_spread``);
    they give torch's sort and scans' tensors (``_group_with_torch``, the reference)."""
    n = ids.numel()
    return _group_spread(ids, num_experts, block_m, -(-n // block_m) + min(num_experts, n))


#: The pairs a grouping program takes. The spread grouping's three launches against one
#: program for every pair (whose work grew as pairs x experts) and torch's dozen: 4.0 /
#: 5.7 / 45.5 us at 1 token, 12.7 / 111.5 / 79.8 at 256, 54.4 / 861.4 / 128.8 at 2,048
#: (Qwen3-30B-A3B's 128 experts, 8 routed; H200, docs/gpu.md "Issue 24, ninth step, and
#: issue 25's fifth").
GROUP_CHUNK = 64


@triton.jit
def _chunk_ranks(ids_ptr, c0, n, E_P2: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs [c0, c0 + CHUNK): their indices, their [CHUNK, E_P2] one-hot matrix of
    experts (rows past n all zero), and each one's rank among the chunk's earlier pairs
    of its expert (the running sums down the matrix's columns)."""
    i = c0 + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + i, mask=i < n, other=E_P2)
    onehot = (e[:, None] == tl.arange(0, E_P2)[None, :]).to(tl.int32)
    return i, onehot, tl.sum(onehot * (tl.cumsum(onehot, 0) - onehot), axis=1)


@triton.jit
def _store_block_experts(ends, block_expert_ptr, num_blocks, EXPERTS: tl.constexpr,
                         E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Each block's expert from the padded runs' ends: the experts whose run ends at or
    before the block's first row (torch.searchsorted(ends, first, right=True))."""
    real = tl.arange(0, E_P2) < EXPERTS
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        done = (ends[None, :] <= (b * BLOCK_M)[:, None]) & real[None, :]
        tl.store(block_expert_ptr + b, tl.sum(done.to(tl.int32), axis=1), mask=b < num_blocks)


@triton.jit
def _group_count_kernel(ids_ptr, rank_ptr, counts_ptr, pairs_ptr, n, slots, fill,
                        E_P2: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
                        EARLY: tl.constexpr):
    """Chunk c of the pairs (a program each): its count of pairs by expert, into row c of
    ``counts`` [chunks, E_P2], and each pair's rank among its chunk's pairs of its
    expert; and slots ``[c * fill, (c + 1) * fill)`` of ``pairs`` set to the padding
    ``n``, which ``_group_place_kernel``, launched after, overwrites where a pair goes."""
    dependent_start(PDL, EARLY)
    c = tl.program_id(0)
    i, onehot, rank = _chunk_ranks(ids_ptr, c * CHUNK, n, E_P2, CHUNK)
    tl.store(rank_ptr + i, rank, mask=i < n)
    tl.store(counts_ptr + c * E_P2 + tl.arange(0, E_P2), tl.sum(onehot, axis=0))
    for s0 in range(c * fill, tl.minimum((c + 1) * fill, slots), CHUNK):
        s = s0 + tl.arange(0, CHUNK)
        tl.store(pairs_ptr + s, tl.zeros((CHUNK,), dtype=tl.int32) + n,
                 mask=(s < slots) & (s < (c + 1) * fill))


@triton.jit
def _group_offsets_kernel(counts_ptr, offsets_ptr, block_expert_ptr, chunks, num_blocks,
                          EXPERTS: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr,
                          CHUNK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """One program: each expert's total, its run's start (the runs padded to whole
    blocks), each chunk's first place for each expert (its run's start plus the earlier
    chunks' pairs of that expert), into ``offsets`` [chunks, E_P2], and each block's
    expert."""
    dependent_start(PDL, EARLY)
    experts = tl.arange(0, E_P2)
    counts = tl.zeros((E_P2,), dtype=tl.int32)
    for c in range(0, chunks):
        counts += tl.load(counts_ptr + c * E_P2 + experts)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    placed = ends - padded
    for c in range(0, chunks):
        tl.store(offsets_ptr + c * E_P2 + experts, placed)
        placed += tl.load(counts_ptr + c * E_P2 + experts)
    _store_block_experts(ends, block_expert_ptr, num_blocks, EXPERTS, E_P2, BLOCK_M, CHUNK)


@triton.jit
def _group_place_kernel(ids_ptr, rank_ptr, offsets_ptr, pairs_ptr, n, E_P2: tl.constexpr,
                        CHUNK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """Chunk c of the pairs (a program each): each pair to its place, its chunk's first
    place for its expert plus its rank there."""
    dependent_start(PDL, EARLY)
    c = tl.program_id(0)
    i = c * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(ids_ptr + i, mask=i < n, other=0)
    place = tl.load(offsets_ptr + c * E_P2 + e, mask=i < n, other=0) + tl.load(
        rank_ptr + i, mask=i < n, other=0)
    tl.store(pairs_ptr + place, i, mask=i < n)


def _group_spread(ids: torch.Tensor, num_experts: int, block_m: int,
                  blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``group_by_expert``'s tensors from three launches, a chunk of GROUP_CHUNK pairs a
    program in the first and the last: counts and ranks by chunk, the offsets in one
    program (a loop over the chunks, not over the pairs), the places."""
    n = ids.numel()
    device = ids.device
    if n == 0:  # no pair, no block
        return (torch.empty((0,), dtype=torch.int32, device=device),
                torch.empty((0,), dtype=torch.int32, device=device))
    flat = ids.reshape(-1).to(torch.int32)
    chunks = -(-n // GROUP_CHUNK)
    e_p2 = triton.next_power_of_2(num_experts)
    slots = blocks * block_m
    pairs = torch.empty((slots,), dtype=torch.int32, device=device)
    block_expert = torch.empty((blocks,), dtype=torch.int32, device=device)
    rank = torch.empty((n,), dtype=torch.int32, device=device)
    counts = torch.empty((chunks, e_p2), dtype=torch.int32, device=device)
    offsets = torch.empty((chunks, e_p2), dtype=torch.int32, device=device)
    fill = -(-slots // chunks)
    _group_count_kernel[(chunks,)](flat, rank, counts, pairs, n, slots, fill, E_P2=e_p2,
                                   CHUNK=GROUP_CHUNK, **launch(device, (chunks,)),
                                   num_warps=4)
    _group_offsets_kernel[(1,)](counts, offsets, block_expert, chunks, blocks,
                                EXPERTS=num_experts, E_P2=e_p2, BLOCK_M=block_m,
                                CHUNK=GROUP_CHUNK, **launch(device, (1,)), num_warps=4)
    _group_place_kernel[(chunks,)](flat, rank, offsets, pairs, n, E_P2=e_p2,
                                   CHUNK=GROUP_CHUNK, **launch(device, (chunks,)),
                                   num_warps=4)
    return pairs, block_expert


def _group_with_torch(ids: torch.Tensor, num_experts: int, block_m: int,
                      blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = ids.numel()
    device = ids.device
    flat = ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first place in ``order``
    rank = torch.arange(n, device=device) - first[by_expert]
    pairs = torch.full((blocks * block_m,), n, dtype=torch.int32, device=device)
    pairs[(ends - padded)[by_expert] + rank] = order.to(torch.int32)
    starts = torch.arange(blocks, device=device) * block_m
    block_expert = torch.searchsorted(ends, starts, right=True).to(torch.int32)
    return pairs, block_expert


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, y_ptr, pairs_ptr, block_expert_ptr, N, K, num_pairs,
                     stride_am, stride_we, stride_wn, stride_ym, NUM_EXPERTS: tl.constexpr,
                     TOP_K: tl.constexpr, GATHER: tl.constexpr, GATED: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """One block of one expert's pairs x one block of output columns: y[pair] = a[row]
    @ w[expert]^T, a's row the pair's token (GATHER) or the pair itself; GATED: w is
    [gate | up] of [2N, K] and y SwiGLU's."""
    dependent_start(PDL, EARLY)
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < NUM_EXPERTS:
        rm = tl.arange(0, BLOCK_M)
        pair = tl.load(pairs_ptr + block * BLOCK_M + rm)
        valid = pair < num_pairs
        row = pair // TOP_K if GATHER else pair
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        w = w_ptr + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            a = tl.load(a_ptr + row[:, None].to(tl.int64) * stride_am + kk[None, :],
                        mask=valid[:, None] & (kk[None, :] < K), other=0.0)
            w_mask = (rn[:, None] < N) & (kk[None, :] < K)
            wg = tl.load(w + rn[:, None] * stride_wn + kk[None, :], mask=w_mask, other=0.0)
            acc += tl.dot(a, tl.trans(wg), input_precision=PRECISION)
            if GATED:
                wu = tl.load(w + (N + rn)[:, None] * stride_wn + kk[None, :], mask=w_mask,
                             other=0.0)
                acc_up += tl.dot(a, tl.trans(wu), input_precision=PRECISION)
        dtype = y_ptr.dtype.element_ty
        y = acc.to(dtype)
        if GATED:
            y = swiglu(y, acc_up.to(dtype))
        tl.store(y_ptr + pair[:, None].to(tl.int64) * stride_ym + rn[None, :], y,
                 mask=valid[:, None] & (rn[None, :] < N))


def moe_gemm(a: torch.Tensor, weight: torch.Tensor, pairs: torch.Tensor,
             block_expert: torch.Tensor, num_pairs: int, top_k: int, *, gather: bool,
             gated: bool, tile: MoeTile = MOE_TILE) -> torch.Tensor:
    """One projection of every routed pair: [num_pairs, N] from ``weight`` [experts,
    N (2N gated), K] and the rows of ``a`` (the pairs' tokens' rows where ``gather``,
    else the pairs' own), grouped by ``group_by_expert`` with ``tile.block_m``."""
    experts, rows, k = weight.shape
    n = rows // 2 if gated else rows
    if pairs.shape[0] != block_expert.shape[0] * tile.block_m:
        raise ValueError(f"{pairs.shape[0]} grouped pairs for {block_expert.shape[0]} "
                         f"blocks of {tile.block_m}: grouped for another tile")
    y = torch.empty((num_pairs, n), dtype=a.dtype, device=a.device)
    grid = (block_expert.shape[0], triton.cdiv(n, tile.block_n))
    _moe_gemm_kernel[grid](
        a, weight, y, pairs, block_expert, n, k, num_pairs, a.stride(0), weight.stride(0),
        weight.stride(1), y.stride(0), NUM_EXPERTS=experts, TOP_K=top_k, GATHER=gather,
        GATED=gated, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=MOE_BLOCK_K,
        PRECISION=precision(a.dtype), **launch(a.device, grid), num_warps=tile.warps, num_stages=tile.stages)
    return y


@triton.jit
def _moe_combine_kernel(y_ptr, ids_ptr, w_ptr, r_ptr, out_ptr, H, stride_y, stride_r,
                        stride_o, TOP_K: tl.constexpr, K_P2: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr):
    """One token, a block of its columns: residual + its experts' outputs times their
    weights, in ascending expert id, each product and sum rounded to the model dtype."""
    dependent_start(PDL, EARLY)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < H
    k = tl.arange(0, K_P2)
    ids = tl.load(ids_ptr + t * TOP_K + k, mask=k < TOP_K, other=2**30)
    # Each slot's place among the token's experts by id (the ids are distinct).
    place = tl.sum((ids[None, :] < ids[:, None]).to(tl.int32), axis=1)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        slot = tl.sum(tl.where(place == j, k, 0), axis=0)
        weight = tl.load(w_ptr + t * TOP_K + slot).to(tl.float32)
        y = tl.load(y_ptr + (t * TOP_K + slot).to(tl.int64) * stride_y + cols, mask=mask,
                    other=0.0)
        product = (y.to(tl.float32) * weight).to(dtype)
        acc = (acc + product.to(tl.float32)).to(dtype).to(tl.float32)
    r = tl.load(r_ptr + t * stride_r + cols, mask=mask, other=0.0)
    tl.store(out_ptr + t * stride_o + cols, (r.to(tl.float32) + acc).to(dtype), mask=mask)


def moe_mlp(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
            residual: torch.Tensor, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """``residual`` + the experts' MLP of ``x`` [T, hidden]: ``logits`` [T, experts] the
    router's, ``gate_up`` [experts, 2 intermediate, hidden] (gate, then up) and
    ``down`` [experts, hidden, intermediate] the experts' weights."""
    t, hidden = x.shape
    experts = gate_up.shape[0]
    if gate_up.shape[2] != hidden or down.shape[:2] != (experts, hidden) or (
            down.shape[2] * 2 != gate_up.shape[1]) or logits.shape != (t, experts):
        raise ValueError(f"expert weights {tuple(gate_up.shape)} and {tuple(down.shape)}, "
                         f"logits {tuple(logits.shape)}, for rows {tuple(x.shape)}")
    out = torch.empty_like(residual)
    if t == 0:
        return out
    ids, weights = route(logits, top_k, norm_topk_prob)
    n = t * top_k
    gate_up_tile, down_tile = moe_tiles(n, experts)
    pairs, block_expert = group_by_expert(ids, experts, gate_up_tile.block_m)
    inner = moe_gemm(x, gate_up, pairs, block_expert, n, top_k, gather=True, gated=True,
                     tile=gate_up_tile)
    y = moe_gemm(inner, down, pairs, block_expert, n, top_k, gather=False, gated=False,
                 tile=down_tile)
    grid = (t, triton.cdiv(hidden, COMBINE_BLOCK))
    _moe_combine_kernel[grid](
        y, ids, weights, residual, out, hidden, y.stride(0), residual.stride(0), out.stride(0),
        TOP_K=top_k, K_P2=triton.next_power_of_2(top_k), BLOCK=COMBINE_BLOCK,
        **launch(y.device, grid), num_warps=4)
    return out
