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
    """One bucket: static inputs, the captured forward, the static logits."""

    def __init__(self, size: int, max_blocks: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.size = size
        self.slots = zeros(size, dtype=torch.int64)  # the token buffer's row
        self.positions = zeros(size, dtype=torch.int64)
        self.cache_slots = zeros(size, dtype=torch.int64)
        self.tables = zeros(size, max_blocks)
        self.ctx_start = zeros(size)
        self.q_len = zeros(size)
        self.attn = Attention(
            positions=self.positions, cache_slots=self.cache_slots, tables=self.tables,
            tile_seq=torch.arange(size, dtype=torch.int32, device=device), tile_row=zeros(size),
            q_start=torch.arange(size, dtype=torch.int32, device=device), q_len=self.q_len,
            ctx_start=self.ctx_start,
        )
        self.graph = torch.cuda.CUDAGraph()
        self.logits = torch.empty(0)

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
        pad = g.size - n
        cache = np.concatenate([cache_slots, np.full(pad, self.scratch_slot, dtype=np.int64)])
        full_tables = np.zeros((g.size, self.max_blocks), dtype=np.int32)
        full_tables[:n, :tables.shape[1]] = tables
        q_len = np.concatenate([np.ones(n, dtype=np.int32), np.zeros(pad, dtype=np.int32)])
        g.slots.copy_(torch.from_numpy(np.concatenate([slots, np.zeros(pad, dtype=np.int64)])))
        g.positions.copy_(torch.from_numpy(np.concatenate([positions, np.zeros(pad, dtype=np.int64)])))
        g.cache_slots.copy_(torch.from_numpy(cache))
        g.tables.copy_(torch.from_numpy(full_tables))
        g.ctx_start.copy_(torch.from_numpy(np.concatenate(
            [positions.astype(np.int32), np.zeros(pad, dtype=np.int32)])))
        g.q_len.copy_(torch.from_numpy(q_len))
        g.graph.replay()
        return g.logits[:n]
