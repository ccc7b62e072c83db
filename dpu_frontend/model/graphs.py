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

import numpy as np
import torch

from dpu_frontend.model.layers.attention import Attention
from dpu_frontend.model.metadata import GraphShape, StepInputs, graph_for, graph_shapes
from dpu_frontend.model.models.base import Decoder


class StepGraph:
    """One captured step of fixed sizes (``GraphShape``)."""

    def __init__(self, shape: GraphShape, device: torch.device, keep_graph: bool = False) -> None:
        self.shape = shape
        self.tokens, self.seqs, self.tiles, self.samples = (shape.tokens, shape.seqs, shape.tiles,
                                                            shape.samples)
        self.inputs = torch.zeros(shape.nbytes, dtype=torch.uint8, device=device)
        # Two host buffers, used in turn: with the engine's steps overlapped, the next
        # step's inputs are written while this one's copy may still wait in the stream.
        self.staging = [torch.zeros(shape.nbytes, dtype=torch.uint8, pin_memory=True)
                        for _ in range(2)]
        self.copied = [torch.cuda.Event() for _ in range(2)]  # each buffer's last copy done
        self.turn = 0
        self.hosts = [shape.views(staging.numpy()) for staging in self.staging]
        self.views: dict[str, torch.Tensor] = {}
        for name, dtype, shape_, offset, nbytes in shape.spans():
            self.views[name] = (self.inputs[offset:offset + nbytes]
                                .view(torch.int64 if dtype == np.int64 else torch.int32)
                                .view(shape_))
        # A decode graph's steps hold no prompt tokens: its attention is one launch.
        self.attn = Attention.of(self.views, prompts=shape.samples is not None)
        # keep_graph: the cudaGraph_t stays for the GPU scheduler to instantiate for
        # device launch (model/gpu_scheduler.py).
        self.graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
        self.logits = torch.empty(0)

    def fits(self, step: StepInputs) -> bool:
        return self.shape.fits(step)

    def load(self, step: StepInputs, scratch_slot: int) -> None:
        """The step's inputs into the static buffers; the rest is padding."""
        turn = self.turn = self.turn ^ 1
        self.copied[turn].synchronize()  # two steps back: long done in an overlapped engine
        self.shape.fill(self.hosts[turn], step, scratch_slot)
        self.inputs.copy_(self.staging[turn], non_blocking=True)
        self.copied[turn].record()

    def capture(self, model: Decoder, tokens: torch.Tensor, pool: object) -> None:
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
    """Every captured step, in ``metadata.graph_shapes``' order."""

    def __init__(self, model: Decoder, tokens: torch.Tensor, max_seqs: int, max_blocks: int,
                 scratch_slot: int, keep_graphs: bool = False) -> None:
        self.model = model
        self.keep_graphs = keep_graphs
        self.tokens = tokens
        self.scratch_slot = scratch_slot
        self.shapes = graph_shapes(max_seqs, max_blocks)
        self.graphs: list[StepGraph] = []
        self.pool: object = None

    def capture(self) -> None:
        device = self.tokens.device
        pool = self.pool = torch.cuda.graph_pool_handle()
        graphs: dict[int, StepGraph] = {}
        # Largest first (the mixed graphs, then the decode graphs): the smaller graphs
        # reuse its memory from the shared pool.
        decode = [i for i, s in enumerate(self.shapes) if s.samples is None]
        mixed = [i for i, s in enumerate(self.shapes) if s.samples is not None]
        for i in [*reversed(mixed), *reversed(decode)]:
            graphs[i] = StepGraph(self.shapes[i], device, self.keep_graphs)
            graphs[i].capture(self.model, self.tokens, pool)
        self.graphs = [graphs[i] for i in range(len(self.shapes))]

    def graph_for(self, step: StepInputs) -> StepGraph | None:
        """The smallest graph that holds ``step``; None: it runs eagerly."""
        i = graph_for(self.shapes, step)
        return None if i is None else self.graphs[i]

    def run(self, graph: StepGraph, step: StepInputs) -> torch.Tensor:
        """Logits [samples, vocab] (a view of the graph's static output, valid until
        its next replay)."""
        graph.load(step, self.scratch_slot)
        graph.graph.replay()
        return graph.logits[:len(step.sample_rows)]
