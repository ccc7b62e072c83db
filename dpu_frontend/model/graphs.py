"""Engine steps as CUDA graphs: decode steps per batch-size bucket, mixed steps per token bucket.

A step's forward and logits run as one graph replay instead of some 600
kernel launches from Python. Two families of graphs, all sharing one memory
pool:

* **decode** graphs, one per batch-size bucket: every sequence adds one
  token (a batch of n runs in the smallest bucket >= n);
* **mixed** graphs, one per token bucket (256 to 2,048 tokens): any step
  whose tokens fit, prefill chunks beside decodes included. At saturation a
  sequence finishes and another starts almost every step, so without them
  nearly every step ran eagerly (measured: 23 ms per token at batch 256
  where the decode step takes 13 ms).

Each graph has static inputs: views of one device buffer, filled from a
pinned host buffer (two, used in turn) by a single copy per step. Rows, sequences, tiles and
logits rows past the step's are padding: padding rows write their K and V
into a scratch block past the pool's blocks, padding tiles belong to a
padding sequence with no query token, and padding logits rows are ignored.
The kernels are batch-invariant, so a padded graph gives each real row the
same bits as the eager path.

The sampler stays outside the graphs: its stages depend on the batch's
parameters (top-k, top-p, penalties present or not).
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import torch

from dpu_frontend.model.metadata import StepInputs
from dpu_frontend.model.qwen3 import Attention, Qwen3

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)
#: Token buckets of the mixed graphs (the engine's default token budget is 2,048).
TOKEN_BUCKETS = (256, 512, 1024, 2048)


class StepGraph:
    """One captured step of fixed sizes: ``tokens`` rows, ``seqs`` sequences,
    ``tiles`` attention tiles, ``samples`` logits rows (``None``: every row, as a
    decode step has)."""

    def __init__(self, tokens: int, seqs: int, tiles: int, samples: int | None,
                 max_blocks: int, device: torch.device) -> None:
        buffers = (("slots", np.int64, (tokens,)), ("positions", np.int64, (tokens,)),
                   ("cache_slots", np.int64, (tokens,)),
                   ("sample_rows", np.int64, (samples or 0,)),
                   ("tables", np.int32, (seqs, max_blocks)), ("tile_seq", np.int32, (tiles,)),
                   ("tile_row", np.int32, (tiles,)), ("q_start", np.int32, (seqs,)),
                   ("q_len", np.int32, (seqs,)), ("ctx_start", np.int32, (seqs,)))
        spans, total = [], 0
        for name, dtype, shape in buffers:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            spans.append((name, dtype, shape, total, nbytes))
            total += -(-nbytes // 8) * 8  # every field 8-byte aligned
        self.tokens, self.seqs, self.tiles, self.samples = tokens, seqs, tiles, samples
        self.inputs = torch.zeros(total, dtype=torch.uint8, device=device)
        # Two host buffers, used in turn: with the engine's steps overlapped, the next
        # step's inputs are written while this one's copy may still wait in the stream.
        self.staging = [torch.zeros(total, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in range(2)]  # each buffer's last copy done
        self.turn = 0
        self.hosts: list[dict[str, np.ndarray]] = [{} for _ in range(2)]
        self.views: dict[str, torch.Tensor] = {}
        for name, dtype, shape, offset, nbytes in spans:
            for staging, host in zip(self.staging, self.hosts, strict=True):
                host[name] = staging.numpy()[offset:offset + nbytes].view(dtype).reshape(shape)
            self.views[name] = (self.inputs[offset:offset + nbytes]
                                .view(torch.int64 if dtype == np.int64 else torch.int32)
                                .view(shape))
        self.attn = Attention(**{f.name: self.views[f.name] for f in fields(Attention)})
        self.graph = torch.cuda.CUDAGraph()
        self.logits = torch.empty(0)

    def fits(self, step: StepInputs) -> bool:
        return (len(step.slots) <= self.tokens and len(step.q_len) < self.seqs + (
            self.samples is None) and len(step.tile_seq) <= self.tiles
            and (self.samples is None or len(step.sample_rows) <= self.samples))

    def load(self, step: StepInputs, scratch_slot: int) -> None:
        """The step's inputs into the static buffers; the rest is padding."""
        turn = self.turn = self.turn ^ 1
        self.copied[turn].synchronize()  # two steps back: long done in an overlapped engine
        h = self.hosts[turn]
        t, s, tiles = len(step.slots), len(step.q_len), len(step.tile_seq)
        h["slots"][:t], h["slots"][t:] = step.slots, 0
        h["positions"][:t], h["positions"][t:] = step.positions, 0
        h["cache_slots"][:t], h["cache_slots"][t:] = step.cache_slots, scratch_slot
        h["tables"][:] = 0
        h["tables"][:s, :step.tables.shape[1]] = step.tables
        for name in ("q_start", "q_len", "ctx_start"):
            h[name][:s], h[name][s:] = getattr(step, name), 0
        # Padding tiles belong to the last sequence: padding, no query token.
        h["tile_seq"][:tiles], h["tile_seq"][tiles:] = step.tile_seq, self.seqs - 1
        h["tile_row"][:tiles], h["tile_row"][tiles:] = step.tile_row, 0
        if self.samples is not None:
            n = len(step.sample_rows)
            h["sample_rows"][:n], h["sample_rows"][n:] = step.sample_rows, 0
        self.inputs.copy_(self.staging[turn], non_blocking=True)
        self.copied[turn].record()

    def capture(self, model: Qwen3, tokens: torch.Tensor, pool: object) -> None:
        v = self.views

        def run() -> torch.Tensor:
            hidden = model.forward(tokens[v["slots"], v["positions"]], self.attn)
            return model.logits(hidden if self.samples is None else hidden[v["sample_rows"]])

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # compiles the Triton kernels and settles the allocator
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = run()


class StepGraphs:
    def __init__(self, model: Qwen3, tokens: torch.Tensor, max_seqs: int, max_blocks: int,
                 scratch_slot: int) -> None:
        self.model = model
        self.tokens = tokens
        self.max_seqs = max_seqs
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_slot
        self.sizes = [b for b in BUCKETS if b < max_seqs] + [max_seqs]
        self.decode: dict[int, StepGraph] = {}
        self.mixed: dict[int, StepGraph] = {}

    def capture(self) -> None:
        device = self.tokens.device
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs reuse its memory from the shared pool.
        for t in sorted(TOKEN_BUCKETS, reverse=True):
            # One sequence more than the engine runs: the padding tiles' own.
            graph = StepGraph(t, self.max_seqs + 1, t, self.max_seqs, self.max_blocks, device)
            graph.capture(self.model, self.tokens, pool)
            self.mixed[t] = graph
        for size in sorted(self.sizes, reverse=True):
            graph = StepGraph(size, size, size, None, self.max_blocks, device)
            graph.capture(self.model, self.tokens, pool)
            self.decode[size] = graph
        # Smallest first: ``graph_for`` takes the first that fits.
        self.decode = dict(sorted(self.decode.items()))
        self.mixed = dict(sorted(self.mixed.items()))

    def graph_for(self, step: StepInputs) -> StepGraph | None:
        """The smallest graph that holds ``step``; None: it runs eagerly."""
        family = self.decode if step.decode else self.mixed
        return next((g for g in family.values() if g.fits(step)), None)

    def run(self, graph: StepGraph, step: StepInputs) -> torch.Tensor:
        """Logits [samples, vocab] (a view of the graph's static output, valid until
        its next replay)."""
        graph.load(step, self.scratch_slot)
        graph.graph.replay()
        return graph.logits[:len(step.sample_rows)]
