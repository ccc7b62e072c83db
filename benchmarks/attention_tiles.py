"""Tiles, warps, pipeline stages and KV splits of the paged-attention kernel, for decode
batches, against the bandwidth bound of reading every sequence's K and V once.

As for the linear tiles, a tile configuration is a candidate only when its output
is bit for bit the current one's. Candidates vary the tile's rows too: a decode tile has
one query token, so rows beyond the KV group's query heads are padding. The split
candidates (programs per tile and KV head, pages per chunk) and the step candidates
(pages a program's loop takes at once) change the reduction order, so their bits differ
by construction: they are timed for the choice of the constants.
The batch is decode-only (one query token per sequence, Qwen3-0.6B's 16 query and 8 KV
heads of 128, or the heads of ``--model-config``), every sequence at ``--context``
tokens (with ``--long``, the first at that many: one long context among short ones, as
a serving batch has) in a paged cache of 32-token blocks spread over the pool. GPU time
from a CUDA graph of launches, median of ``--iters``.

    python -m benchmarks.attention_tiles --batch 1 64 256 --context 1024
    python -m benchmarks.attention_tiles --batch 256 --context 328 --long 3500
    python -m benchmarks.attention_tiles --model-config benchmarks/configs/qwen3-8b.json
"""

from __future__ import annotations

import argparse
import itertools
import re
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import record
from benchmarks.linear_tiles import timed
from benchmarks.model_step import copy_bandwidth
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.layers import attention

#: Tile rows, warps, stages, splits, pages per chunk, pages per step.
Candidate = tuple[int, int, int, int, int, int]
CURRENT: Candidate = (attention.ATTN_ROWS, attention.ATTN_WARPS, attention.ATTN_STAGES,
                      attention.ATTN_SPLITS, attention.ATTN_CHUNK_PAGES,
                      attention.ATTN_STEP_PAGES)
CANDIDATES: list[Candidate] = list(dict.fromkeys(
    [(r, w, st, *CURRENT[3:])
     for r, w, st in itertools.product((16, 32, 64), (4, 8), (2, 3, 4))]
    + [(*CURRENT[:3], sp, cp, CURRENT[5])
       for sp, cp in itertools.product((1, 4, 8, 16), (2, 4, 8, 16))]
    # Short chunks spread a short context over more splits (batch 1's serial chain), with
    # steps of 2 pages inside them.
    + [(CURRENT[0], CURRENT[1], CURRENT[2], sp, cp, 2)
       for sp, cp in itertools.product((8, 16), (2, 4))]
    + [(CURRENT[0], w, st, *CURRENT[3:5], step)
       for w, st, step in itertools.product((4, 8), (2, 3, 4), (1, 2, 4))]))


NAME = "{}r{}w{}s{}x{}p{}st"
NAMED = re.compile(r"^(\d+)r(\d+)w(\d+)s(\d+)x(\d+)p(\d+)st$")


def candidate(text: str) -> Candidate:
    """A candidate from its printed name (``16r4w2s8x8p1st``: rows, warps, stages, splits,
    pages per chunk, pages per step)."""
    found = NAMED.match(text)
    if found is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a candidate's name "
                                         "(ROWSrWARPSwSTAGESsSPLITSxCHUNKpSTEPst)")
    rows, warps, stages, splits, chunk, step = map(int, found.groups())
    return rows, warps, stages, splits, chunk, step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--long", type=int, default=0,
                        help="the first sequence's context (0: as the others)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--model-config", type=Path, metavar="FILE",
                        help="a model's config.json, for its heads (default: Qwen3-0.6B's)")
    parser.add_argument("--only", type=candidate, nargs="+", metavar="NAME",
                        help="time these candidates beside the current one (default: all)")
    args = parser.parse_args(argv)
    candidates = list(dict.fromkeys([CURRENT, *args.only])) if args.only else CANDIDATES
    config = ModelConfig.load(args.model_config) if args.model_config else ModelConfig.default()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)  # bytes moved per second, as benchmarks.model_step
    hq, hkv, dim, page = config.num_heads, config.num_kv_heads, config.head_dim, 32
    figures: dict[str, object] = {"copy bandwidth, GB/s": round(bandwidth / 1e9, 1),
                                  "heads (query, KV, dim)": f"{hq}, {hkv}, {dim}",
                                  "context": args.context, "first sequence's context":
                                  args.long or args.context}
    gen = torch.Generator(device=device).manual_seed(2)
    current = CURRENT
    for n in args.batch:
        contexts = [args.long or args.context] + [args.context] * (n - 1)
        pages = -(-(max(contexts) + 1) // page)
        blocks = n * pages + 1
        k_cache = torch.randn((blocks, hkv, page, dim), generator=gen, device=device,
                              dtype=torch.bfloat16)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(blocks - 1, generator=gen, device=device)[:n * pages]
        tables = tables.view(n, pages).to(torch.int32)
        q = torch.randn((n, hq, dim), generator=gen, device=device, dtype=torch.bfloat16)
        ones = torch.ones(n, dtype=torch.int32, device=device)
        arange = torch.arange(n, dtype=torch.int32, device=device)
        ctx = torch.tensor(contexts, dtype=torch.int32, device=device)
        meta = (tables, arange, torch.zeros_like(ones), arange, ones, ctx, ctx.to(torch.int64))
        outs = {c: torch.empty_like(q) for c in candidates}
        bound_us = (sum(contexts) + n) * hkv * dim * 2 * 2 / bandwidth * 1e6
        times: dict[Candidate, float] = {}
        for c in candidates:
            run = partial(attention.paged_attention, q, k_cache, v_cache, *meta, outs[c],
                          rows=c[0], warps=c[1], stages=c[2], splits=c[3], chunk_pages=c[4],
                          step_pages=c[5])
            try:
                run()
            except Exception as exc:  # out of resources: not a candidate
                print(f"batch {n} {c}: {type(exc).__name__}")
                continue
            times[c] = timed(lambda _: run(), args.iters)  # noqa: B023 (called here)
        base = outs[current]
        exact = {c: t for c, t in times.items() if torch.equal(outs[c], base)}
        best = min(exact, key=exact.__getitem__)
        name = NAME.format
        print(f"batch {n}: bound {bound_us:.1f} us per layer; " + "  ".join(
            f"{name(*c)} {t:.1f}{'' if c in exact else ' (inexact)'}" for c, t in times.items()))
        fastest = min(times, key=times.__getitem__)
        figures[f"batch {n}: fastest {name(*fastest)}, us / bound"] = (
            f"{times[fastest]:.1f} / {bound_us:.1f} ({times[fastest] / bound_us:.2f}x)")
        figures[f"batch {n}: current {name(*current)}, us / bound"] = (
            f"{times[current]:.1f} / {bound_us:.1f} ({times[current] / bound_us:.2f}x)")
        figures[f"batch {n}: best exact {name(*best)}, us / bound"] = (
            f"{exact[best]:.1f} / {bound_us:.1f} ({exact[best] / bound_us:.2f}x)")
        del k_cache, v_cache, outs
        torch.cuda.empty_cache()
    record("attention_tiles", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
