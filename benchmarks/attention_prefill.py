"""Paged attention on prompt chunks and mixed steps, against PyTorch's
``scaled_dot_product_attention`` with the flash backend at the same shapes (issue 24:
prefill and mixed steps no slower than it).

Each case is a step's attention for one layer: ``P`` sequences each with a chunk of
``N`` prompt tokens after ``C`` cached ones (``PxN@C``; ``@C`` left out: a first
chunk), and, for a mixed step, ``D`` decodes at a context of ``Cd`` beside them
(``+DxCd``). The engine runs the step in one launch of its kernel over the paged cache
(32-token pages spread over the pool), as the model does. SDPA gets each part as a
dense batch of equal lengths, its K and V contiguous, built outside the timing: the
prompts in one call (causal; from the lower right where a chunk follows cached
tokens), the decodes in another, the query heads sharing their KV heads
(``enable_gqa``). GPU time of each inside a CUDA graph, median of ``--iters``, beside
the K and V bytes at the copy bandwidth of the same run and each one's TFLOP/s. Both
outputs are compared first (bf16, the same inputs): a case whose outputs differ by
more than 0.05 stops the run.

    python -m benchmarks.attention_prefill --model-config benchmarks/configs/qwen3-8b.json
    python -m benchmarks.attention_prefill --cases 1x2048 8x512 4x512@1024 2x512+256x328

``--tall 2 4`` also times the engine with those tall factors for the prompt tokens
(``layers.attention.ATTN_TALL``: a second launch of taller tiles), beside the default in
the same run, and says whether each gives the default's bits (a factor that does not
cannot become the default).

``--check`` compares the outputs alone (each ``--tall`` factor's too), in float32, on
whatever device torch has (on a machine without a GPU, under ``TRITON_INTERPRET=1``
with small cases); it times nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from benchmarks.common import record
from benchmarks.linear_tiles import timed
from benchmarks.model_step import copy_bandwidth
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.layers.attention import ATTN_ROWS, ATTN_TALL, paged_attention

PAGE = 32
CASES = ("1x2048", "8x512", "32x128", "4x512@1024", "2x512+256x328", "1x2048+64x1024")
CASE = re.compile(r"^(\d+)x(\d+)(?:@(\d+))?(?:\+(\d+)x(\d+))?$")


@dataclass(frozen=True, slots=True)
class Case:
    """``prompts`` chunks of ``tokens`` after ``context`` cached tokens, and ``decodes``
    decodes at ``decode_context`` beside them."""

    prompts: int
    tokens: int
    context: int = 0
    decodes: int = 0
    decode_context: int = 0

    @classmethod
    def parse(cls, text: str) -> Case:
        found = CASE.match(text)
        if found is None:
            raise argparse.ArgumentTypeError(f"{text!r}: PxN, PxN@C or PxN@C+DxCd")
        p, n, c, d, cd = (int(g) if g else 0 for g in found.groups())
        if p < 1 or n < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: at least one prompt of one token")
        return cls(p, n, c, d, cd)

    def __str__(self) -> str:
        text = f"{self.prompts}x{self.tokens}" + (f"@{self.context}" if self.context else "")
        return text + (f"+{self.decodes}x{self.decode_context}" if self.decodes else "")

    def sequences(self) -> list[tuple[int, int]]:
        """(cached tokens, query tokens) of each sequence: the prompts, then the decodes."""
        return ([(self.context, self.tokens)] * self.prompts
                + [(self.decode_context, 1)] * self.decodes)

    def flops(self, heads: int, dim: int) -> int:
        """QK^T and PV over the keys each query sees (causal)."""
        return 4 * heads * dim * sum(n * c + n * (n + 1) // 2 for c, n in self.sequences())


#: ``paged_attention``'s metadata arguments, in order.
Meta = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
             torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """Sequences (cached tokens, query tokens) over one paged cache: each sequence's own
    pages (``pages``), spread over the pool by a permutation, in its block table (the
    unused tail 0); where its query rows start (``starts``); and ``paged_attention``'s
    metadata, tiles of ``per_tile`` query tokens (``meta``: tables, tile_seq, tile_row,
    q_start, q_len, ctx_start, positions)."""

    pages: list[int]
    starts: list[int]
    meta: Meta

    @classmethod
    def of(cls, seqs: list[tuple[int, int]], per_tile: int, spread: torch.Tensor
           ) -> PagedLayout:
        """``spread``: a permutation of the pool's blocks (without the last, scratch)."""
        device = spread.device
        pages = [-(-(c + n) // PAGE) for c, n in seqs]
        tables = torch.zeros((len(seqs), max(pages)), dtype=torch.int32, device=device)
        at = 0
        for i, p in enumerate(pages):
            tables[i, :p] = spread[at:at + p]
            at += p
        starts, tile_seq, tile_row = [], [], []
        for i, (_, n) in enumerate(seqs):
            starts.append(sum(m for _, m in seqs[:i]))
            for r in range(0, n, per_tile):
                tile_seq.append(i)
                tile_row.append(r)

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        positions = [c + t for c, n in seqs for t in range(n)]
        return cls(pages, starts, (
            tables, i32(tile_seq), i32(tile_row), i32(starts), i32([n for _, n in seqs]),
            i32([c for c, _ in seqs]), torch.tensor(positions, dtype=torch.int64,
                                                    device=device)))

    @property
    def tables(self) -> torch.Tensor:
        return self.meta[0]


def blocks_for(seqs: list[tuple[int, int]]) -> int:
    """The pool's blocks for ``seqs``' own pages, and one scratch block past them."""
    return sum(-(-(c + n) // PAGE) for c, n in seqs) + 1


class Step:
    """A case's inputs: the paged cache and the engine's metadata, and the same K, V and
    q as dense tensors for SDPA."""

    def __init__(self, case: Case, config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, gen: torch.Generator) -> None:
        self.case = case
        hq, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
        seqs = case.sequences()
        blocks = blocks_for(seqs)
        self.k = torch.randn((blocks, hkv, PAGE, d), generator=gen, device=device).to(dtype)
        self.v = torch.randn((blocks, hkv, PAGE, d), generator=gen, device=device).to(dtype)
        spread = torch.randperm(blocks - 1, generator=gen, device=device).to(torch.int32)
        layout = PagedLayout.of(seqs, ATTN_ROWS // config.group_size, spread)
        self.tables, self.meta = layout.tables, layout.meta
        tokens = sum(n for _, n in seqs)
        self.q = torch.randn((tokens, hq, d), generator=gen, device=device).to(dtype)
        self.out = torch.empty_like(self.q)
        # SDPA's operands: [batch, heads, length, dim], the prompts' and the decodes'.
        self.groups = [self._dense(range(case.prompts), case.context, case.tokens)]
        if case.decodes:
            first = case.prompts
            self.groups.append(self._dense(range(first, first + case.decodes),
                                           case.decode_context, 1))
        self.sdpa_out = [torch.empty_like(q) for q, _, _, _ in self.groups]

    def _dense(self, seqs: range, context: int, tokens: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        keys = context + tokens
        pages = -(-keys // PAGE)
        table = self.tables[seqs.start:seqs.stop, :pages].long()
        k, v = (x[table].permute(0, 2, 1, 3, 4).reshape(len(seqs), x.shape[1], -1, x.shape[3])
                [:, :, :keys].contiguous() for x in (self.k, self.v))
        first = sum(n for _, n in self.case.sequences()[:seqs.start])
        q = (self.q[first:first + len(seqs) * tokens]
             .view(len(seqs), tokens, *self.q.shape[1:]).transpose(1, 2).contiguous())
        return q, k, v, context

    def engine(self, tall: int = ATTN_TALL) -> torch.Tensor:
        paged_attention(self.q, self.k, self.v, *self.meta, self.out, tall=tall)
        return self.out

    def sdpa(self) -> list[torch.Tensor]:
        for (q, k, v, context), out in zip(self.groups, self.sdpa_out, strict=True):
            tokens, keys = q.shape[2], k.shape[2]
            if tokens == 1:
                mask, causal = None, False  # a decode sees every cached key
            elif context == 0:
                mask, causal = None, True
            else:
                mask, causal = causal_lower_right(tokens, keys), False
            out.copy_(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                     scale=q.shape[-1] ** -0.5, enable_gqa=True))
        return self.sdpa_out

    def error(self, tall: int = ATTN_TALL) -> float:
        """The largest difference between the engine's output (``tall``: its factor for
        the prompt tokens) and SDPA's."""
        engine, dense = self.engine(tall), self.sdpa()
        worst, first = 0.0, 0
        for (q, _, _, _), out in zip(self.groups, dense, strict=True):
            rows = q.shape[0] * q.shape[2]
            ours = engine[first:first + rows].view(q.shape[0], q.shape[2], *q.shape[1::2])
            theirs = out.transpose(1, 2)
            worst = max(worst, (ours.float() - theirs.float()).abs().max().item())
            first += rows
        return worst

    def kv_bytes(self) -> int:
        return sum(2 * (c + n) * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
                   for c, n in self.case.sequences())


def tall_engine(step: Step, tall: int, _: int) -> torch.Tensor:
    return step.engine(tall)


def timings(step: Step, config: ModelConfig, iters: int, bandwidth: float,
            error: float, talls: list[int]) -> dict[str, str]:
    """The engine's and SDPA's GPU time for ``step``, beside its bytes and FLOPs; and
    the engine's with each of ``talls``, with whether it gives the default's bits."""
    engine_us = timed(lambda _: step.engine(), iters)
    with flash(step.q.device):
        sdpa_us = timed(lambda _: step.sdpa(), iters)
    bytes_us = step.kv_bytes() / bandwidth * 1e6
    flops = step.case.flops(config.num_heads, config.head_dim)
    lines = {"engine / SDPA flash, us": (
        f"{engine_us:.1f} / {sdpa_us:.1f} ({engine_us / sdpa_us:.2f}x); K and V bytes "
        f"{bytes_us:.1f} us; {flops / engine_us / 1e6:.0f} / {flops / sdpa_us / 1e6:.0f} "
        f"TFLOP/s; max |difference| {error:.3f}")}
    default = step.engine().clone()
    for tall in talls:
        exact = torch.equal(step.engine(tall), default)
        tall_us = timed(partial(tall_engine, step, tall), iters)
        lines[f"tall {tall}, us"] = (f"{tall_us:.1f} ({tall_us / sdpa_us:.2f}x flash, "
                                     f"{tall_us / engine_us:.2f}x the default); the default's "
                                     f"bits: {'yes' if exact else 'NO'}")
    return lines


@contextlib.contextmanager
def flash(device: torch.device) -> Iterator[None]:
    """SDPA held to the flash backend on a GPU; any backend elsewhere (``--check``)."""
    if device.type != "cuda":
        yield
        return
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        yield


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Case.parse, nargs="+",
                        default=[Case.parse(c) for c in CASES])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--model-config", type=Path, metavar="FILE",
                        help="a model's config.json, for its heads (default: Qwen3-0.6B's)")
    parser.add_argument("--check", action="store_true",
                        help="compare the outputs in float32 and time nothing")
    parser.add_argument("--tall", type=int, nargs="+", default=[], metavar="FACTOR",
                        help="also time these tall factors for the prompt tokens (0: one "
                             "launch of short tiles), beside the default")
    args = parser.parse_args(argv)
    config = ModelConfig.load(args.model_config) if args.model_config else ModelConfig.default()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float32 if args.check else torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(3)
    figures: dict[str, object] = {"heads (query, KV, dim)": (
        f"{config.num_heads}, {config.num_kv_heads}, {config.head_dim}")}
    bandwidth = 0.0
    if not args.check:
        bandwidth = copy_bandwidth(device)
        figures["GPU"] = torch.cuda.get_device_name(device)
        figures["copy bandwidth, GB/s"] = round(bandwidth / 1e9, 1)
    for case in args.cases:
        step = Step(case, config, dtype, device, gen)
        # The flash backend takes 16-bit inputs only: a float32 check runs any backend.
        with contextlib.nullcontext() if args.check else flash(device):
            error = step.error()
        limit = 1e-3 if args.check else 0.05
        if error > limit:
            raise SystemExit(f"{case}: the engine's output is {error:.3g} from SDPA's")
        if args.check:
            figures[f"{case}: max |engine - SDPA|"] = f"{error:.2e}"
            for tall in args.tall:
                tall_error = step.error(tall)
                if tall_error > limit:
                    raise SystemExit(f"{case}: the engine's output with tall {tall} is "
                                     f"{tall_error:.3g} from SDPA's")
                figures[f"{case}: tall {tall}, max |engine - SDPA|"] = f"{tall_error:.2e}"
            continue
        for name, line in timings(step, config, args.iters, bandwidth, error,
                                  args.tall).items():
            figures[f"{case}: {name}"] = line
        del step
        torch.cuda.empty_cache()
    record("attention_prefill", figures)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
