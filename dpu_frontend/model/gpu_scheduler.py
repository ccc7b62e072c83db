"""``model-peer --scheduler gpu``: the engine loop inside the GPU.

The host-driven peer (``--scheduler host``, ``dpu_frontend.model.peer``) reads
the request ring, schedules and launches every step from Python. Here the
host loads the model, captures the step graphs (``graphs.StepGraphs``) and,
per step graph, the sampler in five variants (``SamplerGraphs``), hands all
of it to ``libdpuf_sched.so`` (``dpu_frontend/model/device/scheduler.cu``) and
launches its persistent scheduler once. From then on the GPU takes the
requests from the ring, batches them (the same algorithm as
``model/scheduler.py``, in ``sched_core.h``), launches each step's graphs
itself (device graph launch), publishes the records and retires what ended;
the host answers the control plane only (attach and detach through the
mailbox, stats), as the CUDA peer's launcher does: both are a
``gpu.persistent.PersistentKernel``, with the same region (the shm file, or
under verbs GPU memory registered for the NIC).

The variants exist because the host path skips sampler stages a batch does
not need; a captured graph cannot. Each stage leaves a row with neutral
parameters bit for bit as it was, so the scheduler picks the cheapest
variant that covers the batch and every row draws the token the host path
would draw. A batch with a constrained row (structured output) takes the
``constrained`` variant: every stage, the log probabilities, and the mask and
state step of ``layers.constrain`` over the runner's automata, which the
scheduler copies out of the arena into the runner's pool (one copy per
constraint, checked on the GPU before it is walked).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.persistent import PersistentKernel
from dpu_frontend.model.device.sched_core import (
    ERRORS,
    MAX_EOS,
    ModelParams,
    ModelStats,
    SchedConfig,
    SchedulerLibrary,
)
from dpu_frontend.model.graphs import StepGraph
from dpu_frontend.model.layers.attention import ATTN_ROWS
from dpu_frontend.model.layers.sampler import BatchParams
from dpu_frontend.model.metadata import SamplingRows
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.model.sampling import VARIANTS
from dpu_frontend.ring import Layout
from dpu_frontend.ring.layout import CHANNEL_SIZE, HEADER_SIZE, MAX_TOP_LOGPROBS

log = logging.getLogger("dpu_frontend.model")

#: What the sampler graphs hold at most at once, in [rows, vocab] tensors of 8 bytes: an
#: estimate from the full variant's stages (its two sorts' values and indices, the
#: masks, the draw's hash words) and the constrained variant's masked copy of the
#: logits, not a measurement.
SAMPLER_TEMPORARIES = 13


def sampler_reserve(runner: ModelRunner) -> int:
    """Bytes the sampler graphs hold beside the KV cache: the largest draws
    ``SAMPLER_TEMPORARIES`` [rows, vocab] tensors of 8 bytes at once."""
    return SAMPLER_TEMPORARIES * runner.options.max_seqs * runner.config.vocab_size * 8


class SamplerGraphs:
    """The sampler's static rows and outputs, and per step graph its four variants.

    Row ``k`` of a step is its ``k``-th sampling sequence: the slot and position
    its token goes to, its parameters (``row_floats`` [6, rows] as
    ``metadata.SamplingRows``, ``row_ints`` [3, rows]: top_k, seed bits, output
    index). Padding rows draw into the token buffer's padding row."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        rows, device = runner.options.max_seqs, runner.device
        self.rows = rows
        self.row_slot = torch.full((rows,), rows, dtype=torch.int64, device=device)
        self.row_pos = torch.zeros(rows, dtype=torch.int64, device=device)
        self.row_floats = torch.zeros((6, rows), dtype=torch.float32, device=device)
        self.row_ints = torch.zeros((3, rows), dtype=torch.int64, device=device)
        self.out_tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.out_logprob = torch.zeros(rows, dtype=torch.float32, device=device)
        self.out_top_ids = torch.zeros((rows, MAX_TOP_LOGPROBS), dtype=torch.int64, device=device)
        self.out_top_logprobs = torch.zeros((rows, MAX_TOP_LOGPROBS), dtype=torch.float32,
                                            device=device)
        self.graphs: list[list[torch.cuda.CUDAGraph]] = []

    def _sample(self, logits: torch.Tensor, variant: str) -> None:
        """What a sampler graph runs: the runner's own ``Sampler.step`` over the static
        rows, with the stages of ``variant``, its results into the static outputs."""
        runner = self.runner
        n = logits.shape[0]
        f, i = self.row_floats[:, :n], self.row_ints[:, :n]
        params = BatchParams(temperature=f[0], top_p=f[1], min_p=f[2], presence=f[3],
                             frequency=f[4], repetition=f[5], top_k=i[0], seed=i[1], step=i[2],
                             host=SamplingRows.stages_of(variant, logits.shape[1]))
        logprobs = variant in ("logprobs", "constrained")
        drawn = runner.sampler.step(logits, params, self.row_slot[:n], self.row_pos[:n],
                                    runner.slots, MAX_TOP_LOGPROBS if logprobs else -1,
                                    runner.automata if variant == "constrained" else None)
        self.out_tokens[:n].copy_(drawn.tokens)
        if drawn.logprob is not None and drawn.top_ids is not None and drawn.top_logprobs is not None:
            self.out_logprob[:n].copy_(drawn.logprob)
            self.out_top_ids[:n].copy_(drawn.top_ids)
            self.out_top_logprobs[:n].copy_(drawn.top_logprobs)

    def capture(self, steps: list[StepGraph], pool: object) -> None:
        """A graph per variant per step graph, sharing ``pool``; largest first."""
        order = sorted(range(len(steps)), key=lambda g: -steps[g].logits.shape[0])
        graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        for g in order:
            logits = steps[g].logits
            graphs[g] = []
            for variant in VARIANTS:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._sample(logits, variant)  # warm-up: kernels loaded, allocator settled
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph(keep_graph=True)
                with torch.cuda.graph(graph, pool=pool):
                    self._sample(logits, variant)
                graphs[g].append(graph)
        self.graphs = [graphs[g] for g in range(len(steps))]


class GpuSchedulerKernel(PersistentKernel[SchedulerLibrary]):
    """The model behind the ring with its scheduler on the GPU (``scheduler.cu``)."""

    what = "the GPU scheduler"

    def __init__(self, runner: ModelRunner, eos: tuple[int, ...], library: SchedulerLibrary, *,
                 max_batched_tokens: int, heartbeat_us: float = 100.0,
                 idle_us: float = 2.0) -> None:
        if runner.graphs is None:
            raise StartupError("--scheduler gpu launches captured steps: drop --no-cuda-graphs")
        if len(eos) > MAX_EOS:
            raise StartupError(f"the model has {len(eos)} EOS ids; the GPU scheduler takes {MAX_EOS}")
        largest = max(s.tokens for s in runner.graphs.shapes if s.samples is not None)
        if max_batched_tokens > largest:
            raise StartupError(f"--max-batched-tokens {max_batched_tokens} is more than the largest "
                               f"captured step ({largest} tokens)")
        super().__init__(runner.options.device)
        self._given = library
        self.runner = runner
        self.eos = eos
        self.max_batched_tokens = max_batched_tokens
        self.heartbeat_ns = int(heartbeat_us * 1000)
        self.idle_ns = int(idle_us * 1000)
        self.samplers = SamplerGraphs(runner)

    def capture(self) -> None:
        """The sampler graphs (before the ready line: a capture that fails fails the start)."""
        graphs = self.runner.graphs
        assert graphs is not None
        self.samplers.capture(graphs.graphs, graphs.pool)

    def _load_library(self) -> SchedulerLibrary:
        return self._given  # loaded before the model (model/peer.py: scheduler_library)

    def _params(self, layout: Layout, region_host: int | None) -> ModelParams:
        if not self.samplers.graphs:
            self.capture()
        runner, o, s = self.runner, self.runner.options, self.samplers
        c, automata = runner.config, runner.automata
        header = layout.encode()
        descs = ctypes.create_string_buffer(header[HEADER_SIZE:], CHANNEL_SIZE * len(layout.channels))
        self._keep.append(descs)
        sched = SchedConfig(max_seqs=o.max_seqs, max_batched_tokens=self.max_batched_tokens,
                            max_model_len=o.max_model_len, block_size=o.block_size,
                            num_blocks=runner.num_blocks,
                            capacity=sum(ch.max_sequences for ch in layout.channels),
                            per_tile=ATTN_ROWS // c.group_size,
                            scratch_slot=runner.num_blocks * o.block_size)
        eos = list(self.eos)
        return ModelParams(
            region_host=region_host, region_size=layout.region_size,
            channels=ctypes.cast(descs, ctypes.c_void_p), channel_count=len(layout.channels),
            eos_count=len(eos), eos=(ctypes.c_uint32 * MAX_EOS)(*eos, *[0] * (MAX_EOS - len(eos))),
            # The tokenizer's ids: what a prompt may hold and what the automata are over.
            device=o.device, vocab=o.vocab_limit or c.vocab_size, heartbeat_ns=self.heartbeat_ns,
            idle_ns=self.idle_ns, sched=sched, tokens=runner.slots.tokens.data_ptr(),
            counts=runner.slots.counts.data_ptr(), in_prompt=runner.slots.in_prompt.data_ptr(),
            vocab_rows=c.vocab_size, rows_stride=s.rows, row_slot=s.row_slot.data_ptr(),
            row_pos=s.row_pos.data_ptr(), row_floats=s.row_floats.data_ptr(),
            row_ints=s.row_ints.data_ptr(), out_tokens=s.out_tokens.data_ptr(),
            out_logprob=s.out_logprob.data_ptr(), out_top_ids=s.out_top_ids.data_ptr(),
            out_top_logprobs=s.out_top_logprobs.data_ptr(),
            automata=automata.pool.data_ptr(), automata_words=automata.words,
            automaton_meta=automata.meta.data_ptr(), automaton_state=automata.state.data_ptr())

    def _created(self, lib: SchedulerLibrary, handle: int, layout: Layout) -> None:
        """The step graphs, each with its sampler variants, instantiated for device launch."""
        graphs = self.runner.graphs
        assert graphs is not None
        torch.cuda.synchronize()
        for g, (shape, step) in enumerate(zip(graphs.shapes, graphs.graphs, strict=True)):
            lib.check(lib.add_graph(handle, shape.tokens, shape.seqs, shape.tiles, shape.samples,
                                    step.inputs.data_ptr(), step.graph.raw_cuda_graph(),
                                    [v.raw_cuda_graph() for v in self.samplers.graphs[g]]),
                      f"step graph {g}")

    def _running(self) -> None:
        log.info("GPU scheduler running: %d step graphs, %d sampler variants each",
                 len(self.samplers.graphs), len(VARIANTS))

    def _returned(self) -> str:
        error = int(self.stats().error)
        return ("the GPU scheduler returned" if not error
                else f"the GPU scheduler stopped: {ERRORS.get(error, error)}")

    def stats(self) -> ModelStats:
        return self.library().stats(self.handle())

    def kernel_stats(self) -> dict[str, Any]:
        if self._handle is None:
            return {}
        st = self.stats()
        out = {name: int(getattr(st, name)) for name, _ in ModelStats._fields_
               if name != "variants"}
        out.update({f"steps_{v}": int(st.variants[i]) for i, v in enumerate(VARIANTS)})
        return {"scheduler": "gpu", **out}
