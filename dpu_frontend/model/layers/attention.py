# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Causal attention over the paged KV cache, and the step metadata it reads.

A step's tokens come from many sequences (prefill chunks and decodes mixed);
``Attention`` says where each goes in the cache and what each query sees. The
kernel cuts the work into tiles of query tokens, and each query's keys into
chunks at fixed positions: both depend on the query alone, never on the batch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from dpu_frontend.model.layers.linear import precision
from dpu_frontend.model.layers.pdl import dependent_start, launch
from dpu_frontend.model.layers.quant import cache_scales

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
#: 4 splits of 2-page steps (docs/gpu.md, "Issue 24, seventh step"; H200, 2026-12-01):
#: against 8 splits of 1-page steps, 3-4 us less a layer at batches 1 and 8 (a program's
#: serial chain halved) and as fast or faster from 64 to 512 (half the partials to merge),
#: at Qwen3-8B's and 0.6B's heads, contexts 328 and 1,024.
ATTN_SPLITS = 4
#: Pages a program's loop takes in one step: their keys in one score tile and one
#: softmax update. A chunk's pages are stepped through from its first, so the steps,
#: like the chunks, sit at positions fixed by the query alone.
ATTN_STEP_PAGES = 2
#: The attention kernel's warps and pipeline stages (benchmarks/attention_tiles.py).
ATTN_WARPS = 4
ATTN_STAGES = 2
#: Tall prompt tiles: a sequence with more query tokens than one tile holds (a prompt
#: chunk) runs, in a second launch, tiles of this many short tiles' tokens, which read
#: each key once for that many times the tokens; decodes keep their short tiles. 0: one
#: launch of short tiles for every sequence. A tall tile must give each row the short
#: tile's bits (a preempted sequence recomputes as a prompt what it had decoded), and
#: tests/gpu/test_attention.py holds factor 2 to it. On the H200 (docs/gpu.md, "Issue 24,
#: ninth step") factor 2 (32 rows at a group of 4) is exact and takes 5-16% off prompt
#: chunks of 512 tokens and more, but costs 6% on 128-token chunks and 13% on a mixed
#: step of 256 decodes, serving's common step, whose decodes and prompts no longer share
#: a launch; factor 4 (64 rows) is 0.62x on long prompts but gives other bits. So 0.
ATTN_TALL = 0


@dataclass
class Attention:
    """Where this step's tokens go in the cache and what each query sees."""

    positions: torch.Tensor  # [T] int64
    cache_slots: torch.Tensor  # [T] int64: block * page + offset
    tables: torch.Tensor  # [S, max_blocks] int32
    tile_seq: torch.Tensor  # [tiles] int32
    tile_row: torch.Tensor  # [tiles] int32
    q_start: torch.Tensor  # [S] int32
    q_len: torch.Tensor  # [S] int32
    ctx_start: torch.Tensor  # [S] int32
    #: The tall factor for the step's prompt tokens (``ATTN_TALL``); 0 for a step of
    #: decodes alone, which needs no second launch. Not a tensor: fixed by the step's
    #: family when a graph is captured.
    tall: int = 0

    @classmethod
    def inputs(cls) -> list[str]:
        """The tensor fields' names: those of the step's inputs it is made of."""
        return [f.name for f in fields(cls) if f.name != "tall"]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor], prompts: bool) -> Attention:
        """The fields' tensors by name (a step's inputs, or a graph's views of them);
        ``prompts``: the step may hold prompt tokens."""
        return cls(**{name: tensors[name] for name in cls.inputs()},
                   tall=ATTN_TALL if prompts else 0)


@dataclass
class KvCache:
    """Every layer's K and V, [layers, blocks, kv_heads, page, head_dim]: the pool's
    blocks and one scratch block past them, where a graph's padding rows write. In FP8
    (``--kv-cache-dtype fp8``, e4m3), with a float32 scale per token and head beside
    each, [layers, blocks, kv_heads, page] (``quant``'s rule)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def page(self) -> int:
        return int(self.k.shape[3])

    def scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer ``layer``'s K and V scales; (None, None) for a cache of the model dtype."""
        if self.k_scale is None or self.v_scale is None:
            return None, None
        return self.k_scale[layer], self.v_scale[layer]


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, part_ptr, tables_ptr, tile_seq_ptr, tile_row_ptr,
    q_start_ptr, q_len_ptr, ctx_start_ptr,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_sb, stride_sh, stride_pt,
    stride_ph, stride_table, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, ROWS: tl.constexpr,
    PRECISION: tl.constexpr, SPLITS: tl.constexpr, CHUNK_PAGES: tl.constexpr,
    STEP_PAGES: tl.constexpr, FP8_KV: tl.constexpr, TILE_TOKENS: tl.constexpr,
    TOKENS: tl.constexpr, PASS: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):
    """One tile's softmax over its chunks s, s + SPLITS, ... (s: the split), unnormalized:
    per row the running max m, the sum l and the weighted values acc, into ``part``
    [tokens, heads, SPLITS, HEAD_DIM + 2] float32. An FP8 cache's keys and values are
    widened to q's dtype (exactly) for the MMAs, and their scales, one a token, applied
    to the scores and to the softmax weights.

    The metadata's tiles hold ``TILE_TOKENS`` query tokens each; a program takes
    ``TOKENS`` from its tile's first, in ``ROWS`` rows. ``PASS`` 0: every tile (TOKENS
    = TILE_TOKENS). 1: the tiles of sequences that fit one tile (decodes). 2: the
    others' (prompt chunks), tall: a program for each run of TOKENS // TILE_TOKENS
    tiles, at its first tile, the others' programs idle."""
    dependent_start(PDL, EARLY)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_row_ptr + tile)  # the tile's first query token within the sequence's work
    q_start = tl.load(q_start_ptr + seq)
    q_len = tl.load(q_len_ptr + seq)
    ctx_start = tl.load(ctx_start_ptr + seq)
    last = ctx_start + tl.minimum(first + TOKENS, q_len) - 1  # the program's largest position
    chunks = last // (PAGE * CHUNK_PAGES) + 1
    mine = split < chunks
    if PASS == 1:
        mine = mine & (q_len <= TILE_TOKENS)
    elif PASS == 2:
        mine = mine & (q_len > TILE_TOKENS) & (first % TOKENS == 0)
    if mine:
        r = tl.arange(0, ROWS)
        token = first + r // GROUP
        head = kv_head * GROUP + r % GROUP
        # A group that does not divide ROWS leaves rows past the program's last token:
        # they are the next one's, whose keys this one may not hold.
        valid = (token < q_len) & (r < TOKENS * GROUP)
        pos = ctx_start + token  # the query's position: it sees keys 0..pos
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh
                    + d[None, :], mask=valid[:, None], other=0.0)
        m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((ROWS,), dtype=tl.float32)
        acc = tl.zeros((ROWS, HEAD_DIM), dtype=tl.float32)
        keys = tl.arange(0, STEP_PAGES * PAGE)
        pages = last // PAGE + 1
        for chunk in range(split, chunks, SPLITS):
            end = tl.minimum((chunk + 1) * CHUNK_PAGES, pages)
            for first_page in range(chunk * CHUNK_PAGES, end, STEP_PAGES):
                if STEP_PAGES == 1:
                    block = tl.load(tables_ptr + seq * stride_table + first_page).to(tl.int64)
                    base = block * stride_kb + kv_head * stride_kh
                    k_at = k_ptr + base + keys[:, None] * stride_ks + d[None, :]
                    v_at = v_ptr + base + keys[:, None] * stride_ks + d[None, :]
                    at = block * stride_sb + kv_head * stride_sh + keys
                else:
                    # Each key's page; a step past the tile's last page reads that page
                    # again, its keys past every row's position (masked below).
                    page = tl.minimum(first_page + keys // PAGE, pages - 1)
                    block = tl.load(tables_ptr + seq * stride_table + page).to(tl.int64)
                    base = block * stride_kb + kv_head * stride_kh + (keys % PAGE) * stride_ks
                    k_at = k_ptr + base[:, None] + d[None, :]
                    v_at = v_ptr + base[:, None] + d[None, :]
                    at = block * stride_sb + kv_head * stride_sh + keys % PAGE
                k = tl.load(k_at)
                if FP8_KV:
                    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
                    s = s * tl.load(ks_ptr + at)[None, :] * scale
                else:
                    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
                key_pos = first_page * PAGE + keys
                s = tl.where((key_pos[None, :] <= pos[:, None]) & valid[:, None], s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                # Rows with nothing visible (padding rows, rows before this split's
                # keys) keep m = -inf: guard the NaN. A step wholly past a row's
                # position leaves its m, l and acc bit for bit as they were.
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp(m_i - m_safe)
                p = tl.exp(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_at)
                if FP8_KV:
                    pv = p * tl.load(vs_ptr + at)[None, :]
                    acc = acc * alpha[:, None] + tl.dot(pv.to(q.dtype), v.to(q.dtype),
                                                        input_precision=PRECISION)
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                                        input_precision=PRECISION)
                m_i = m_new
        out = part_ptr + (q_start + token) * stride_pt + head * stride_ph + split * (HEAD_DIM + 2)
        tl.store(out[:, None] + d[None, :], acc, mask=valid[:, None])
        tl.store(out + HEAD_DIM, m_i, mask=valid)
        tl.store(out + HEAD_DIM + 1, l_i, mask=valid)


@triton.jit
def _merge_splits_kernel(part_ptr, o_ptr, pos_ptr, stride_pt, stride_ph, stride_ot, stride_oh,
                         HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr, CHUNK: tl.constexpr,
                         PDL: tl.constexpr, EARLY: tl.constexpr):
    """One query token and head: its splits' partial softmaxes merged, in split order."""
    dependent_start(PDL, EARLY)
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
                    chunk_pages: int = ATTN_CHUNK_PAGES, step_pages: int = ATTN_STEP_PAGES,
                    tall: int = 0, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Causal attention of ``q`` [T, Hq, D] over the paged cache [blocks, Hkv, PAGE, D].

    Sequence ``s`` owns query rows ``q_start[s] .. q_start[s] + q_len[s]``, at
    positions from ``ctx_start[s]`` (``positions``: each row's), and its keys are
    its block table's first pages. The work is cut into tiles of ``ATTN_ROWS //
    group`` query tokens (``tile_seq``, ``tile_row``: the sequence and its first
    token), one program per tile, KV head and split (``ATTN_SPLITS``), then one per
    query token and head merges the splits. ``rows`` is the tile's height;
    ``warps``, ``stages``, ``splits``, ``chunk_pages`` and ``step_pages`` override the
    module's (benchmarks: other values give other bits). ``tall`` (``ATTN_TALL``,
    ``Attention.tall``): the sequences of more than one tile run in a second launch,
    ``tall`` tiles' tokens a program. An FP8 cache comes with its scales, ``k_scale``
    and ``v_scale`` [blocks, Hkv, PAGE] (``KvCache``).
    """
    t, hq, dim = q.shape
    _, hkv, page, _ = k_cache.shape
    group = hq // hkv
    if v_cache.dtype != k_cache.dtype or v_cache.stride() != k_cache.stride():
        raise ValueError("the K and V caches must have one dtype and one layout")
    scales = cache_scales(k_cache, k_scale, v_scale)
    if chunk_pages % step_pages:
        raise ValueError(f"a chunk of {chunk_pages} pages is not whole steps of {step_pages}")
    if tile_seq.shape[0] == 0:
        return
    part = torch.empty((t, hq, splits, dim + 2), dtype=torch.float32, device=q.device)
    # The scales' pointers, unused for a cache of the model dtype: any tensor.
    ks, vs = scales or (part, part)
    grid = (tile_seq.shape[0], hkv, splits)
    per_tile = rows // group
    # (pass, tokens a program, its rows): one launch of short tiles, or with ``tall``
    # the decodes' short tiles and then the prompts' tall ones.
    passes = ([(0, per_tile, rows)] if not tall else
              [(1, per_tile, rows),
               (2, tall * per_tile, triton.next_power_of_2(tall * per_tile * group))])
    for kind, tokens, height in passes:
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, ks, vs, part, tables, tile_seq, tile_row, q_start, q_len,
            ctx_start, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), ks.stride(0), ks.stride(1), part.stride(0), part.stride(1),
            tables.stride(0), dim ** -0.5,
            GROUP=group, HEAD_DIM=dim, PAGE=page, ROWS=height, PRECISION=precision(q.dtype),
            SPLITS=splits, CHUNK_PAGES=chunk_pages, STEP_PAGES=step_pages,
            FP8_KV=scales is not None, TILE_TOKENS=per_tile, TOKENS=tokens, PASS=kind,
            **launch(q.device, grid), num_warps=warps or ATTN_WARPS,
            num_stages=stages or ATTN_STAGES,
        )
    _merge_splits_kernel[(t, hq)](
        part, out, positions, part.stride(0), part.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=dim, SPLITS=splits, CHUNK=page * chunk_pages,
        **launch(part.device, (t, hq)), num_warps=4)


