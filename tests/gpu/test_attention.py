"""Paged attention (``layers.attention``) on a real GPU, by itself: decodes and prompt
chunks at contexts across its chunks and splits are attention, in bf16 and over an FP8
cache, and a sequence's bits do not depend on the batch around it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from benchmarks.attention_prefill import PagedLayout, blocks_for
from dpu_frontend.model.layers.attention import (
    ATTN_ROWS,
    ATTN_STEP_PAGES,
    ATTN_TALL,
    paged_attention,
)
from dpu_frontend.model.layers.quant import FP8

pytestmark = pytest.mark.gpu

#: Qwen3-8B's heads, and the engine's page.
HQ, HKV, DIM, PAGE = 32, 8, 128, 32
SEED = 20261128


class Batch:
    """Sequences (context before, query tokens) over one paged cache, with the
    kernel's metadata: tiles of ``ATTN_ROWS // group`` query tokens."""

    def __init__(self, seqs: list[tuple[int, int]], gen: torch.Generator, *,
                 fp8: bool = False) -> None:
        self.seqs = seqs
        blocks = blocks_for(seqs)
        dev = "cuda"
        k, v = (torch.randn((blocks, HKV, PAGE, DIM), generator=gen, device=dev)
                for _ in range(2))
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None
        if fp8:
            ks, vs = (torch.rand((blocks, HKV, PAGE), generator=gen, device=dev) + 0.5
                      for _ in range(2))
            self.k, self.v = (k * 50).to(FP8), (v * 50).to(FP8)  # within e4m3's 448
            self.scales = (ks / 50, vs / 50)
        else:
            self.k, self.v = k.to(torch.bfloat16), v.to(torch.bfloat16)
        # Each sequence's own pages, spread over the pool.
        spread = torch.randperm(blocks - 1, generator=gen, device=dev).to(torch.int32)
        layout = PagedLayout.of(seqs, ATTN_ROWS // (HQ // HKV), spread)
        self.tables, self.pages, self.starts, self.meta = (
            layout.tables, layout.pages, layout.starts, layout.meta)
        tokens = sum(n for _, n in seqs)
        self.q = torch.randn((tokens, HQ, DIM), generator=gen, device=dev).to(torch.bfloat16)

    def run(self, **kwargs: Any) -> torch.Tensor:
        out = torch.full_like(self.q, float("nan"))
        k_scale, v_scale = self.scales or (None, None)
        paged_attention(self.q, self.k, self.v, *self.meta, out, k_scale=k_scale,
                        v_scale=v_scale, **kwargs)
        torch.cuda.synchronize()
        return out

    def rows(self, out: torch.Tensor, i: int) -> torch.Tensor:
        return out[self.starts[i]:self.starts[i] + self.seqs[i][1]]

    def reference(self, i: int) -> torch.Tensor:
        """Sequence ``i``'s output in float32 from the cache's values."""
        c, n = self.seqs[i]
        k, v = (x.float() for x in (self.k, self.v))
        if self.scales is not None:
            k, v = k * self.scales[0][..., None], v * self.scales[1][..., None]
        table = self.tables[i, :self.pages[i]].long()
        keys = k[table].permute(1, 0, 2, 3).reshape(HKV, -1, DIM)[:, :c + n]
        values = v[table].permute(1, 0, 2, 3).reshape(HKV, -1, DIM)[:, :c + n]
        group = HQ // HKV
        q = self.rows(self.q, i).float().permute(1, 0, 2)  # [HQ, n, DIM]
        scores = q @ keys.repeat_interleave(group, 0).transpose(1, 2) * DIM ** -0.5
        pos = torch.arange(c, c + n, device="cuda")
        hidden = torch.arange(c + n, device="cuda")[None, :] > pos[:, None]
        weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        return (weights @ values.repeat_interleave(group, 0)).permute(1, 0, 2)


#: Decodes at contexts from one key to more chunks than splits (each boundary of a
#: chunk and a split), and prompt chunks that start inside a chunk and cross several.
MIXED = ([(c, 1) for c in (0, 1, 31, 255, 256, 257, 511, 700, 1023, 1024, 1800, 2047, 2048,
                          2300, 4095, 4096, 5000)]
         + [(0, 40), (250, 20), (500, 300), (1000, 3), (2040, 17), (3000, 64)])


#: Pages a program's loop takes at once: the engine's, and the benchmark's candidates.
STEPS = sorted({ATTN_STEP_PAGES, 1, 2, 4})


@pytest.mark.parametrize("step", STEPS, ids=lambda n: f"{n}-page-steps")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_decodes_and_prompt_chunks_at_every_split_are_attention(fp8: bool, step: int) -> None:
    """Each sequence's rows against float32 attention over the cache's values."""
    batch = Batch(MIXED, torch.Generator(device="cuda").manual_seed(SEED), fp8=fp8)
    out = batch.run(step_pages=step)
    assert not out.isnan().any()
    for i in range(len(MIXED)):
        error = (batch.rows(out, i).float() - batch.reference(i)).abs().max().item()
        assert error < 0.03, (MIXED[i], error)


@pytest.mark.parametrize("step", STEPS, ids=lambda n: f"{n}-page-steps")
def test_a_sequence_alone_gives_its_bits_in_a_batch_of_512(step: int) -> None:
    """A decode at each context (one to nine chunks), and a prompt chunk, alone and
    first or last among 511 others: the same bits."""
    gen = torch.Generator().manual_seed(SEED + 1)
    for seq in [(c, 1) for c in (100, 300, 600, 900, 1100, 1500, 2100, 2300)] + [(200, 48)]:
        others = [(int(c), 1) for c in torch.randint(0, 1200, (511,), generator=gen)]
        for position in (0, 511):
            seqs = [*others[:position], seq, *others[position:]]
            batch = Batch(seqs, torch.Generator(device="cuda").manual_seed(SEED + 2))
            alone = Batch([seq], torch.Generator(device="cuda").manual_seed(SEED + 2))
            # The same cache contents for the sequence: copy its pages and queries over.
            mine, theirs = alone.tables[0].long(), batch.tables[position, :alone.pages[0]].long()
            alone.k[mine], alone.v[mine] = batch.k[theirs], batch.v[theirs]
            alone.q.copy_(batch.rows(batch.q, position))
            assert torch.equal(alone.run(step_pages=step),
                               batch.rows(batch.run(step_pages=step), position)), (seq, position)


#: The tall factors: the engine's, and 2, the exact candidate (4, 64-row tiles, gives
#: other bits on the H200: docs/gpu.md, "Issue 24, ninth step").
TALLS = sorted({ATTN_TALL, 2} - {0})


@pytest.mark.parametrize("tall", TALLS, ids=lambda n: f"tall-{n}")
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_tall_prompt_tiles_give_the_short_tiles_bits(fp8: bool, tall: int) -> None:
    """The prompt chunks of a mixed step in tall tiles (a second launch) and the decodes
    beside them in short ones: every row bit for bit one launch of short tiles, the rule
    that lets a preempted sequence recompute as a prompt what it decoded. With prompts
    of one token, a tile's worth and more, starting inside a chunk and crossing several,
    tall runs of full and partial tiles, at 1-, 2- and 4-page steps."""
    seqs = [*MIXED, (0, 4), (0, 5), (10, 16), (31, 17), (1500, 63), (4000, 130)]
    for step in STEPS:
        batch = Batch(seqs, torch.Generator(device="cuda").manual_seed(SEED + 3), fp8=fp8)
        short, tall_out = batch.run(step_pages=step), batch.run(step_pages=step, tall=tall)
        assert not tall_out.isnan().any()
        for i, seq in enumerate(seqs):
            assert torch.equal(batch.rows(tall_out, i), batch.rows(short, i)), (seq, step)
