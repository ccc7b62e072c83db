"""``model-peer --scheduler gpu``: the engine loop inside the GPU.

The host-driven peer (``--scheduler host``, ``dpu_frontend.model.peer``) reads
the request ring, schedules and launches every step from Python. Here the
host loads the model, captures the step graphs (``graphs.StepGraphs``) and,
per step graph, the sampler in four variants (``SamplerGraphs``), hands all
of it to ``libdpuf_sched.so`` (``dpu_frontend/model/device/scheduler.cu``) and
launches its persistent scheduler once. From then on the GPU takes the
requests from the ring, batches them (the same algorithm as
``model/scheduler.py``, in ``sched_core.h``), launches each step's graphs
itself (device graph launch), publishes the records and retires what ended;
the host answers the control plane only (attach and detach through the
mailbox, stats), as the CUDA peer's launcher does (``gpu/launcher.py``).

The variants exist because the host path skips sampler stages a batch does
not need; a captured graph cannot. Each stage leaves a row with neutral
parameters bit for bit as it was, so the scheduler picks the cheapest
variant that covers the batch and every row draws the token the host path
would draw.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from pathlib import Path
from typing import Any

import torch

from dpu_frontend.config import PeerConfig
from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.runtime import build, default_build_dir
from dpu_frontend.model.device import SCHEDULER
from dpu_frontend.model.device.sched_core import (
    ERRORS,
    MAX_EOS,
    ModelParams,
    ModelStats,
    SchedConfig,
)
from dpu_frontend.model.graphs import StepGraph
from dpu_frontend.model.layers.attention import ATTN_ROWS
from dpu_frontend.model.layers.sampler import BatchParams
from dpu_frontend.model.metadata import SamplingRows
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.model.sampling import VARIANTS
from dpu_frontend.peer.kernel import PeerKernel, RegionAddress
from dpu_frontend.ring import Layout
from dpu_frontend.ring.layout import CHANNEL_SIZE, HEADER_SIZE, MAX_TOP_LOGPROBS
from dpu_frontend.ring.mailbox import KERNEL_BLOCK, KernelState, mailbox_area_size
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.transport.shm import map_file

log = logging.getLogger("dpu_frontend.model")

#: What the sampler graphs hold at most at once, in [rows, vocab] tensors of 8 bytes: an
#: estimate from the full variant's stages (its two sorts' values and indices, the
#: masks, the draw's hash words), not a measurement.
SAMPLER_TEMPORARIES = 12


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
        drawn = runner.sampler.step(logits, params, self.row_slot[:n], self.row_pos[:n],
                                    runner.slots, MAX_TOP_LOGPROBS if variant == "logprobs" else -1)
        self.out_tokens[:n].copy_(drawn.tokens)
        if drawn.logprob is not None and drawn.top_ids is not None and drawn.top_logprobs is not None:
            self.out_logprob[:n].copy_(drawn.logprob)
            self.out_top_ids[:n].copy_(drawn.top_ids)
            self.out_top_logprobs[:n].copy_(drawn.top_logprobs)

    def capture(self, steps: list[StepGraph], pool: object) -> None:
        """Four graphs per step graph, sharing ``pool``; largest first."""
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


class ModelLibrary:
    """``libdpuf_sched.so``; every failure raises with the library's reason."""

    def __init__(self, path: Path) -> None:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise StartupError(f"cannot load the GPU scheduler library {path}: {exc}") from exc
        vp, i32, u32, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint64
        signatures = {
            "dpuf_model_last_error": ((), ctypes.c_char_p),
            "dpuf_model_create": ((ctypes.POINTER(ModelParams),), vp),
            "dpuf_model_add_graph": ((vp, i32, i32, i32, i32, vp, u64,
                                      ctypes.POINTER(ctypes.c_uint64)), ctypes.c_int),
            "dpuf_model_write_region": ((vp, u64, ctypes.c_char_p, u64), ctypes.c_int),
            "dpuf_model_mailbox": ((vp,), vp),
            "dpuf_model_stats_mirror": ((vp,), vp),
            "dpuf_model_writer_mirror": ((vp,), vp),
            "dpuf_model_launch": ((vp,), ctypes.c_int),
            "dpuf_model_poll": ((vp,), ctypes.c_int),
            "dpuf_model_stop": ((vp, u32), ctypes.c_int),
            "dpuf_model_destroy": ((vp,), None),
        }
        for name, (args, restype) in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, restype
        self.lib = lib

    def error(self) -> str:
        message = self.lib.dpuf_model_last_error()
        return message.decode(errors="replace") if message else "unknown error"

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise StartupError(f"{what}: {self.error()}")


class GpuSchedulerKernel(PeerKernel):
    """The model behind the ring with its scheduler on the GPU (``PeerKernel``)."""

    def __init__(self, peer: PeerConfig, runner: ModelRunner, eos: tuple[int, ...], *,
                 max_batched_tokens: int, library: Path | None = None,
                 build_dir: Path | None = None, heartbeat_us: float = 100.0,
                 idle_us: float = 2.0) -> None:
        if peer.transport != "shm":
            raise StartupError("--scheduler gpu serves the shm transport on this release; the "
                               "verbs transport (a GPU-memory region) runs --scheduler host")
        if runner.graphs is None:
            raise StartupError("--scheduler gpu launches captured steps: drop --no-cuda-graphs")
        if len(eos) > MAX_EOS:
            raise StartupError(f"the model has {len(eos)} EOS ids; the GPU scheduler takes {MAX_EOS}")
        largest = max(s.tokens for s in runner.graphs.shapes if s.samples is not None)
        if max_batched_tokens > largest:
            raise StartupError(f"--max-batched-tokens {max_batched_tokens} is more than the largest "
                               f"captured step ({largest} tokens)")
        self.peer = peer
        self.runner = runner
        self.eos = eos
        self.max_batched_tokens = max_batched_tokens
        self.library_path = library
        self.build_dir = build_dir
        self.heartbeat_ns = int(heartbeat_us * 1000)
        self.idle_ns = int(idle_us * 1000)
        self.samplers = SamplerGraphs(runner)
        self._lib: ModelLibrary | None = None
        self._handle: int | None = None
        self._map: Any = None
        self._mailbox: AtomicMemory | None = None
        self._keep: list[Any] = []
        self._failure: str | None = None
        self._channels = 0

    def capture(self) -> None:
        """The sampler graphs (before the ready line: a capture that fails fails the start)."""
        graphs = self.runner.graphs
        assert graphs is not None
        self.samplers.capture(graphs.graphs, graphs.pool)

    def _library(self) -> ModelLibrary:
        if self._lib is None:
            path = self.library_path
            if path is None:
                major, minor = torch.cuda.get_device_capability(self.runner.device)
                path = build(self.build_dir or default_build_dir(), SCHEDULER,
                             arch=f"sm_{major}{minor}")
            self._lib = ModelLibrary(path)
        return self._lib

    def _params(self, layout: Layout, region_host: int) -> ModelParams:
        runner, o, s = self.runner, self.runner.options, self.samplers
        c = runner.config
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
            device=o.device, vocab=c.vocab_size, heartbeat_ns=self.heartbeat_ns,
            idle_ns=self.idle_ns, sched=sched, tokens=runner.slots.tokens.data_ptr(),
            counts=runner.slots.counts.data_ptr(), in_prompt=runner.slots.in_prompt.data_ptr(),
            vocab_rows=c.vocab_size, rows_stride=s.rows, row_slot=s.row_slot.data_ptr(),
            row_pos=s.row_pos.data_ptr(), row_floats=s.row_floats.data_ptr(),
            row_ints=s.row_ints.data_ptr(), out_tokens=s.out_tokens.data_ptr(),
            out_logprob=s.out_logprob.data_ptr(), out_top_ids=s.out_top_ids.data_ptr(),
            out_top_logprobs=s.out_top_logprobs.data_ptr())

    def open(self, layout: Layout) -> RegionAddress:
        lib = self._library()
        if not self.samplers.graphs:
            self.capture()
        self._map = map_file(str(self.peer.shm_path), layout.region_size, create=True)
        anchor = ctypes.c_char.from_buffer(self._map)
        self._keep.append(anchor)
        handle = lib.lib.dpuf_model_create(ctypes.byref(self._params(layout, ctypes.addressof(anchor))))
        if not handle:
            raise StartupError(f"cannot create the GPU scheduler: {lib.error()}")
        self._handle = handle
        graphs = self.runner.graphs
        assert graphs is not None
        torch.cuda.synchronize()
        for g, (shape, step) in enumerate(zip(graphs.shapes, graphs.graphs, strict=True)):
            samplers = (ctypes.c_uint64 * len(VARIANTS))(
                *(v.raw_cuda_graph() for v in self.samplers.graphs[g]))
            lib.check(lib.lib.dpuf_model_add_graph(
                handle, shape.tokens, shape.seqs, shape.tiles,
                -1 if shape.samples is None else shape.samples, step.inputs.data_ptr(),
                step.graph.raw_cuda_graph(), samplers), f"step graph {g}")
        header = layout.encode()
        lib.check(lib.lib.dpuf_model_write_region(handle, 0, header, len(header)),
                  "writing the layout record")
        self._channels = len(layout.channels)
        size = mailbox_area_size(self._channels)
        buffer = (ctypes.c_char * size).from_address(lib.lib.dpuf_model_mailbox(handle))
        self._mailbox = AtomicMemory(buffer)
        return RegionAddress(path=str(self.peer.shm_path))

    @property
    def mailbox(self) -> AtomicMemory:
        if self._mailbox is None:
            raise RuntimeError("kernel not opened")
        return self._mailbox

    async def start(self) -> None:
        lib, handle = self._library(), self._require()
        lib.check(lib.lib.dpuf_model_launch(handle), "launching the GPU scheduler")
        for _ in range(10_000):
            if self.mailbox.load_acquire(KERNEL_BLOCK.offset("state")) == KernelState.RUNNING:
                log.info("GPU scheduler running: %d step graphs, %d sampler variants each",
                         len(self.samplers.graphs), len(VARIANTS))
                return
            if self.failure() is not None:
                break
            await asyncio.sleep(0.001)
        raise StartupError(f"the GPU scheduler did not start: {self.failure() or 'timeout'}")

    def _require(self) -> int:
        if self._handle is None:
            raise RuntimeError("kernel not opened")
        return self._handle

    def stats(self) -> ModelStats:
        lib, handle = self._library(), self._require()
        mirror = ModelStats.from_address(lib.lib.dpuf_model_stats_mirror(handle))
        out = ModelStats()
        ctypes.memmove(ctypes.byref(out), ctypes.byref(mirror), ctypes.sizeof(ModelStats))
        return out

    def failure(self) -> str | None:
        if self._failure is None and self._handle is not None and self._lib is not None:
            rc = self._lib.lib.dpuf_model_poll(self._handle)
            if rc == 0:
                error = int(self.stats().error)
                self._failure = ("the GPU scheduler returned" if not error
                                 else f"the GPU scheduler stopped: {ERRORS.get(error, error)}")
            elif rc < 0:
                self._failure = f"the GPU scheduler failed: {self._lib.error()}"
        return self._failure

    def kernel_stats(self) -> dict[str, Any]:
        if self._handle is None:
            return {}
        st = self.stats()
        out = {name: int(getattr(st, name)) for name, _ in ModelStats._fields_
               if name != "variants"}
        out.update({f"steps_{v}": int(st.variants[i]) for i, v in enumerate(VARIANTS)})
        return {"scheduler": "gpu", **out}

    def channel_stats(self, channel: int) -> dict[str, Any]:
        return {"kernel_steps": self.mailbox.load_acquire(KERNEL_BLOCK.offset("steps")),
                "kernel_heartbeats": self.mailbox.load_acquire(KERNEL_BLOCK.offset("heartbeats"))}

    async def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the kernels, free what the library holds, remove the shm file."""
        if self._handle is not None and self._lib is not None:
            if self._lib.lib.dpuf_model_stop(self._handle, 5000) != 0:
                log.error("the GPU scheduler did not stop: %s", self._lib.error())
            if self._mailbox is not None:
                self._mailbox.release()
            self._mailbox = None
            self._lib.lib.dpuf_model_destroy(self._handle)
            self._handle = None
        self._keep.clear()
        if self._map is not None:
            self._map.close()
            self._map = None
            Path(self.peer.shm_path).unlink(missing_ok=True)
