# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""The engine's own GPU kernels (Triton): linear layers, RMSNorm, paged attention.

Every kernel here is **batch-invariant**: a row's result does not depend on
how many other rows share the launch or where it sits among them. Each output
element is reduced in one fixed order, set by a tile configuration chosen per
weight shape and dtype, never per batch size (cuBLAS picks its algorithm by
M, and a sequence's logits would then change with the batch). That is what
makes a seeded sequence's tokens the same alone and inside a batch, and a
prompt prefilled in chunks the same as in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Rows (tokens x query heads of a KV group) per attention program: 16, so that a
#: decode tile (one token: the group's 2 heads) wastes little of its MMA. Prompt and
#: decode tokens run the same tiles, so that a token's bits never depend on which
#: it was (a preempted sequence recomputes its tokens as a prompt).
ATTN_ROWS = 16
#: Split KV: a query's keys are cut at fixed positions into chunks of this many
#: pages, and ``ATTN_SPLITS`` programs share them (program s takes chunks s,
#: s + ATTN_SPLITS, ...); a second kernel merges their partial softmaxes. The cut
#: depends on the query's position alone, never on the batch: a long context no
#: longer makes one program the step's critical path, and the bits stay the same.
ATTN_CHUNK_PAGES = 8
ATTN_SPLITS = 8
#: The attention kernel's warps and pipeline stages (benchmarks/attention_tiles.py).
ATTN_WARPS = 4
ATTN_STAGES = 2


def _precision(dtype: torch.dtype) -> str:
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
#: Measured on an H200 (docs/gpu.md, "Linear tiles"): narrower, deeper tiles for the
#: Qwen3-0.6B projections back to the hidden size, whose N of 1024 gives the default
#: tile too few programs to fill the GPU.
LINEAR_TILES: dict[tuple[int, int], Tile] = {
    (1024, 2048): (64, 32, 128, 4, 3),  # o_proj
    (1024, 3072): (64, 32, 128, 4, 4),  # down
    # The LM head over a step's sampled rows: 128-row tiles read its 311 MB weight half
    # as often at large batches (H100, 256 rows: 280 against 480 us; 1 row: 112 against
    # 107 us).
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
                         BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, PRECISION=_precision(x.dtype),
                         num_warps=warps, num_stages=stages)
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, N, stride_x, stride_y, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < N, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
    # As HF's Qwen3RMSNorm: normalize in float32, round to the input dtype, then
    # multiply by the weight in that dtype.
    y = (x * rstd).to(w.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, one program per row."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty_like(rows)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, y, n, rows.stride(0), y.stride(0), eps,
                                           BLOCK=triton.next_power_of_2(n), num_warps=4)
    return y.view(x.shape)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, part_ptr, tables_ptr, tile_seq_ptr, tile_row_ptr,
    q_start_ptr, q_len_ptr, ctx_start_ptr,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_pt, stride_ph, stride_table,
    scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, ROWS: tl.constexpr,
    PRECISION: tl.constexpr, SPLITS: tl.constexpr, CHUNK_PAGES: tl.constexpr,
):
    """One tile's softmax over its chunks s, s + SPLITS, ... (s: the split), unnormalized:
    per row the running max m, the sum l and the weighted values acc, into ``part``
    [tokens, heads, SPLITS, HEAD_DIM + 2] float32."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_row_ptr + tile)  # the tile's first query token within the sequence's work
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_len_ptr + seq)
    ctx_start = tl.load(ctx_start_ptr + seq)
    last = ctx_start + tl.minimum(first + ROWS // GROUP, q_len) - 1  # the tile's largest position
    chunks = last // (PAGE * CHUNK_PAGES) + 1
    if split < chunks:
        r = tl.arange(0, ROWS)
        token = first + r // GROUP
        head = kv_head * GROUP + r % GROUP
        valid = token < q_len
        pos = ctx_start + token  # the query's position: it sees keys 0..pos
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
                    + d[None, :], mask=valid[:, None], other=0.0)
        m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((ROWS,), dtype=tl.float32)
        acc = tl.zeros((ROWS, HEAD_DIM), dtype=tl.float32)
        n = tl.arange(0, PAGE)
        pages = last // PAGE + 1
        for chunk in range(split, chunks, SPLITS):
            for page in range(chunk * CHUNK_PAGES, tl.minimum((chunk + 1) * CHUNK_PAGES, pages)):
                block = tl.load(tables_ptr + seq * stride_table + page).to(tl.int64)
                base = block * stride_kb + kv_head * stride_kh
                k = tl.load(k_ptr + base + n[:, None] * stride_ks + d[None, :])
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                key_pos = page * PAGE + n
                s = tl.where((key_pos[None, :] <= pos[:, None]) & valid[:, None], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                # Rows with nothing visible (padding rows, rows before this split's
                # keys) keep m = -inf: guard the NaN. A page wholly past a row's
                # position leaves its m, l and acc bit for bit as they were.
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_ptr + base + n[:, None] * stride_ks + d[None, :])
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
        out = part_ptr + (q_start + token) * stride_pt + head * stride_ph + split * (HEAD_DIM + 2)
        tl.store(out[:, None] + d[None, :], acc, mask=valid[:, None])
        tl.store(out + HEAD_DIM, m_i, mask=valid)
        tl.store(out + HEAD_DIM + 1, l_i, mask=valid)


@triton.jit
def _merge_splits_kernel(part_ptr, o_ptr, pos_ptr, stride_pt, stride_ph, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr):
    """One query token and head: its splits' partial softmaxes merged, in split order."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    sp = tl.arange(0, SPLITS)
    live = sp <= pos // CHUNK  # the splits that hold this query's keys
    d = tl.arange(0, HEAD_DIM)
    base = part_ptr + t * stride_pt + h * stride_ph + sp * (HEAD_DIM + 2)
    m = tl.load(base + HEAD_DIM, mask=live, other=float("-inf"))
    sums = tl.load(base + HEAD_DIM + 1, mask=live, other=0.0)
    acc = tl.load(base[:, None] + d[None, :], mask=live[:, None], other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(live & (m > float("-inf")), tl.exp(m - top), 0.0)
    total = tl.sum(sums * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    tables: torch.Tensor, tile_seq: torch.Tensor, tile_row: torch.Tensor,
                    q_start: torch.Tensor, q_len: torch.Tensor, ctx_start: torch.Tensor,
                    positions: torch.Tensor, out: torch.Tensor, *, rows: int = ATTN_ROWS,
                    warps: int = 0, stages: int = 0, splits: int = ATTN_SPLITS,
                    chunk_pages: int = ATTN_CHUNK_PAGES) -> None:
    """Causal attention of ``q`` [T, Hq, D] over the paged cache [blocks, Hkv, PAGE, D].

    Sequence ``s`` owns query rows ``q_start[s] .. q_start[s] + q_len[s]``, at
    positions from ``ctx_start[s]`` (``positions``: each row's), and its keys are
    its block table's first pages. The work is cut into tiles of ``ATTN_ROWS //
    group`` query tokens (``tile_seq``, ``tile_row``: the sequence and its first
    token), one program per tile, KV head and split (``ATTN_SPLITS``), then one per
    query token and head merges the splits. ``rows`` is the tile's height;
    ``warps``, ``stages``, ``splits`` and ``chunk_pages`` override the module's
    (benchmarks: other values give other bits).
    """
    t, hq, dim = q.shape
    _, hkv, page, _ = k_cache.shape
    group = hq // hkv
    if tile_seq.shape[0] == 0:
        return
    part = torch.empty((t, hq, splits, dim + 2), dtype=torch.float32, device=q.device)
    _paged_attention_kernel[(tile_seq.shape[0], hkv, splits)](
        q, k_cache, v_cache, part, tables, tile_seq, tile_row, q_start, q_len, ctx_start,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        part.stride(0), part.stride(1), tables.stride(0), dim ** -0.5,
        GROUP=group, HEAD_DIM=dim, PAGE=page, ROWS=rows, PRECISION=_precision(q.dtype),
        SPLITS=splits, CHUNK_PAGES=chunk_pages,
        num_warps=warps or ATTN_WARPS, num_stages=stages or ATTN_STAGES,
    )
    _merge_splits_kernel[(t, hq)](
        part, out, positions, part.stride(0), part.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=dim, SPLITS=splits, CHUNK=page * chunk_pages, num_warps=4)


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


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, N, stride_x, stride_y, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch: silu in float32 rounded to the dtype, then the product rounded.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(y_ptr + row * stride_y + cols, y, mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(gate) * up`` for ``x`` = [gate | up] of [T, 2I]."""
    t, n2 = x.shape
    n = n2 // 2
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        block = 1024
        _silu_mul_kernel[(t, triton.cdiv(n, block))](x, y, n, x.stride(0), y.stride(0), BLOCK=block,
                                                   num_warps=4)
    return y
