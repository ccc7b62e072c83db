"""Decode steps as CUDA graphs, one per batch-size bucket.

A decode-only batch (every sequence adds one token) runs the forward and the
logits as one graph replay instead of some 600 kernel launches from Python.
Each bucket has static input buffers; a batch smaller than its bucket is
padded with rows that attend to nothing and write their K and V into a
scratch block past the pool's blocks. The kernels are batch-invariant, so a
padded graph gives each real row the same bits as the eager path.

The sampler stays outside the graphs: its stages depend on the batch's
parameters (top-k, top-p, penalties present or not).
"""

from __future__ import annotations

import numpy as np
import torch

from dpu_frontend.model.qwen3 import Attention, Qwen3

BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraph:
    """One bucket: static inputs, the captured forward, the static logits.

    The inputs are views of one device buffer, filled from one pinned host
    buffer by a single copy per step (six pageable copies cost more than the
    small graphs they feed)."""

    def __init__(self, size: int, max_blocks: int, device: torch.device) -> None:
        fields = (("slots", np.int64, (size,)),  # the token buffer's row
                  ("positions", np.int64, (size,)), ("cache_slots", np.int64, (size,)),
                  ("tables", np.int32, (size, max_blocks)), ("ctx_start", np.int32, (size,)),
                  ("q_len", np.int32, (size,)))
        spans, total = [], 0
        for name, dtype, shape in fields:
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            spans.append((name, dtype, shape, total, nbytes))
            total += -(-nbytes // 8) * 8  # every field 8-byte aligned
        self.size = size
        self.inputs = torch.zeros(total, dtype=torch.uint8, device=device)
        self.staging = torch.zeros(total, dtype=torch.uint8, pin_memory=True)
        self.copied = torch.cuda.Event()  # the last copy out of ``staging`` is done
        host = self.staging.numpy()
        self.host: dict[str, np.ndarray] = {}
        views: dict[str, torch.Tensor] = {}
        for name, dtype, shape, offset, nbytes in spans:
            self.host[name] = host[offset:offset + nbytes].view(dtype).reshape(shape)
            views[name] = (self.inputs[offset:offset + nbytes]
                           .view(torch.int64 if dtype == np.int64 else torch.int32).view(shape))
        self.slots, self.positions = views["slots"], views["positions"]
        self.cache_slots, self.tables = views["cache_slots"], views["tables"]
        self.ctx_start, self.q_len = views["ctx_start"], views["q_len"]
        self.attn = Attention(
            positions=self.positions, cache_slots=self.cache_slots, tables=self.tables,
            tile_seq=torch.arange(size, dtype=torch.int32, device=device),
            tile_row=torch.zeros(size, dtype=torch.int32, device=device),
            q_start=torch.arange(size, dtype=torch.int32, device=device), q_len=self.q_len,
            ctx_start=self.ctx_start,
        )
        self.graph = torch.cuda.CUDAGraph()
        self.logits = torch.empty(0)

    def load(self, slots: np.ndarray, positions: np.ndarray, cache_slots: np.ndarray,
             tables: np.ndarray, scratch_slot: int) -> None:
        """The batch's inputs into the static buffers (rows past it are padding)."""
        self.copied.synchronize()
        n, h = len(slots), self.host
        h["slots"][:n], h["slots"][n:] = slots, 0
        h["positions"][:n], h["positions"][n:] = positions, 0
        h["cache_slots"][:n], h["cache_slots"][n:] = cache_slots, scratch_slot
        h["tables"][:] = 0
        h["tables"][:n, :tables.shape[1]] = tables
        h["ctx_start"][:n], h["ctx_start"][n:] = positions, 0
        h["q_len"][:n], h["q_len"][n:] = 1, 0
        self.inputs.copy_(self.staging, non_blocking=True)
        self.copied.record()

    def capture(self, model: Qwen3, tokens: torch.Tensor, pool: object) -> None:
        def run() -> torch.Tensor:
            return model.logits(model.forward(tokens[self.slots, self.positions], self.attn))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()  # compiles the Triton kernels and settles the allocator
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = run()


class DecodeGraphs:
    def __init__(self, model: Qwen3, tokens: torch.Tensor, max_seqs: int, max_blocks: int,
                 scratch_slot: int) -> None:
        self.model = model
        self.tokens = tokens
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_slot
        self.sizes = [b for b in BUCKETS if b < max_seqs] + [max_seqs]
        self.graphs: dict[int, DecodeGraph] = {}

    def capture(self) -> None:
        device = self.tokens.device
        pool = torch.cuda.graph_pool_handle()
        # Largest first: the smaller graphs reuse its memory from the shared pool.
        for size in sorted(self.sizes, reverse=True):
            graph = DecodeGraph(size, self.max_blocks, device)
            graph.capture(self.model, self.tokens, pool)
            self.graphs[size] = graph

    def bucket(self, n: int) -> DecodeGraph:
        return self.graphs[next(b for b in self.sizes if b >= n)]

    def run(self, slots: np.ndarray, positions: np.ndarray, cache_slots: np.ndarray,
            tables: np.ndarray) -> torch.Tensor:
        """Logits [n, vocab] of a decode batch of n sequences (a view of the
        bucket's static output, valid until the next replay)."""
        n = len(slots)
        g = self.bucket(n)
        g.load(slots, positions, cache_slots, tables, self.scratch_slot)
        g.graph.replay()
        return g.logits[:n]
