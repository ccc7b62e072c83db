"""The GPU scheduler's structures and library binding, and its core (``sched_core.h``)
built for the host.

The scheduler kernel (``scheduler.cu``) runs ``sched_core.h`` on the GPU. The
same C, built for the host from ``sched_host.c``, is what the CPU tests hold
to the Python scheduler (``dpu_frontend.model.scheduler``) and the step
metadata (``dpu_frontend.model.metadata``): same batches, same preemptions,
same bytes in a graph's static inputs. ``SchedConfig``, ``SeqState``,
``ModelParams`` and ``ModelStats`` mirror the headers' structures, and
``SchedulerLibrary`` binds ``libdpuf_sched.so``'s API (no torch here: CI checks
the offsets, and the model peer checks the GPU with it before the model loads).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dpu_frontend.gpu.library import PersistentLibrary, Signature, bind
from dpu_frontend.gpu.runtime import build_host
from dpu_frontend.model.device import SCHED_HOST
from dpu_frontend.model.sampling import VARIANTS

#: Return codes of sched_core.h.
OK, FULL, BAD_PROMPT, BAD_ENTRY, NO_GRAPH = 0, -1, -2, -3, -4
#: dpuf_sched_seq.status
SEQ_FREE, SEQ_WAITING, SEQ_RUNNING, SEQ_FINISHED = 0, 1, 2, 3
MAX_CHANNELS = 64
MAX_GRAPHS = 64


class SchedConfig(ctypes.Structure):
    """Mirror of ``dpuf_sched_config``."""

    _fields_ = (
        ("max_seqs", ctypes.c_int32),
        ("max_batched_tokens", ctypes.c_int32),
        ("max_model_len", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("num_blocks", ctypes.c_int32),
        ("capacity", ctypes.c_int32),
        ("per_tile", ctypes.c_int32),
        ("scratch_slot", ctypes.c_int32),
    )


class SeqState(ctypes.Structure):
    """Mirror of ``dpuf_sched_seq``."""

    _fields_ = (
        ("seq_id", ctypes.c_int64),
        ("prompt_len", ctypes.c_int32),
        ("limit", ctypes.c_int32),
        ("slot", ctypes.c_int32),
        ("computed", ctypes.c_int32),
        ("generated", ctypes.c_int32),
        ("status", ctypes.c_int32),
        ("channel", ctypes.c_int32),
        ("n_blocks", ctypes.c_int32),
    )


MAX_EOS = 8


class ModelParams(ctypes.Structure):
    """Mirror of ``dpuf_model_params`` (CI checks every offset against the header)."""

    _fields_ = (
        ("region_host", ctypes.c_void_p),
        ("region_size", ctypes.c_uint64),
        ("channels", ctypes.c_void_p),
        ("channel_count", ctypes.c_uint32),
        ("eos_count", ctypes.c_uint32),
        ("eos", ctypes.c_uint32 * MAX_EOS),
        ("device", ctypes.c_int32),
        ("vocab", ctypes.c_uint32),
        ("heartbeat_ns", ctypes.c_uint64),
        ("idle_ns", ctypes.c_uint64),
        ("sched", SchedConfig),
        ("tokens", ctypes.c_void_p),
        ("counts", ctypes.c_void_p),
        ("in_prompt", ctypes.c_void_p),
        ("vocab_rows", ctypes.c_uint32),
        ("rows_stride", ctypes.c_uint32),
        ("row_slot", ctypes.c_void_p),
        ("row_pos", ctypes.c_void_p),
        ("row_floats", ctypes.c_void_p),
        ("row_ints", ctypes.c_void_p),
        ("out_tokens", ctypes.c_void_p),
        ("out_logprob", ctypes.c_void_p),
        ("out_top_ids", ctypes.c_void_p),
        ("out_top_logprobs", ctypes.c_void_p),
        ("automata", ctypes.c_void_p),
        ("automata_words", ctypes.c_uint64),
        ("automaton_meta", ctypes.c_void_p),
        ("automaton_state", ctypes.c_void_p),
    )


class ModelStats(ctypes.Structure):
    """Mirror of ``dpuf_model_stats``."""

    _fields_ = (
        ("steps", ctypes.c_uint64),
        ("tokens", ctypes.c_uint64),
        ("sampled", ctypes.c_uint64),
        ("admitted", ctypes.c_uint64),
        ("preemptions", ctypes.c_uint64),
        ("refused", ctypes.c_uint64),
        ("idle_polls", ctypes.c_uint64),
        ("held", ctypes.c_uint64),
        ("variants", ctypes.c_uint64 * len(VARIANTS)),
        ("running", ctypes.c_uint64),
        ("waiting", ctypes.c_uint64),
        ("free_blocks", ctypes.c_uint64),
        ("error", ctypes.c_uint64),
        ("ns_publish", ctypes.c_uint64),
        ("ns_intake", ctypes.c_uint64),
        ("ns_schedule", ctypes.c_uint64),
        ("ns_prepare", ctypes.c_uint64),
        ("ns_idle", ctypes.c_uint64),
        ("ns_step", ctypes.c_uint64),
        ("context_tokens", ctypes.c_uint64),
        ("constrained", ctypes.c_uint64),
        ("automata_copied", ctypes.c_uint64),
        ("automata_evicted", ctypes.c_uint64),
        ("automata_refused", ctypes.c_uint64),
        ("spread_schedules", ctypes.c_uint64),
        ("sum_running", ctypes.c_uint64),
        ("sum_waiting", ctypes.c_uint64),
        ("ns_idle_waiting", ctypes.c_uint64),
    )


#: dpuf_model_stats.error
ERRORS = {1: "a step no captured graph holds", 2: "a device graph launch failed",
          3: "the record writer reported an error"}


class SchedulerLibrary(PersistentLibrary):
    """``libdpuf_sched.so`` (scheduler.h): the persistent-kernel API, ``dpuf_model_*``, and
    the scheduler's own: its step graphs, its counters."""

    what = "the GPU scheduler library"
    last_error = "dpuf_model_last_error"
    prefix = "dpuf_model"
    device_query = "dpuf_model_device_info_get"
    params = ModelParams

    @classmethod
    def api(cls) -> dict[str, Signature]:
        vp, i32, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint64
        return {**super().api(),
                "dpuf_model_add_graph": ((vp, i32, i32, i32, i32, vp, u64,
                                          ctypes.POINTER(u64)), ctypes.c_int),
                "dpuf_model_stats_mirror": ((vp,), vp),
                "dpuf_model_writer_mirror": ((vp,), vp)}

    def add_graph(self, handle: int, tokens: int, seqs: int, tiles: int, samples: int | None,
                  inputs: int, forward: int, samplers: Sequence[int]) -> int:
        """A captured step (its sizes, its static inputs, its forward graph and one sampler
        graph per variant, as ``cudaGraph_t`` handles), in the order the scheduler tries
        them."""
        variants = (ctypes.c_uint64 * len(VARIANTS))(*samplers)
        return int(self.lib.dpuf_model_add_graph(handle, tokens, seqs, tiles,
                                                 -1 if samples is None else samples, inputs,
                                                 forward, variants))

    def stats(self, handle: int) -> ModelStats:
        """A copy of the counters' pinned mirror."""
        mirror = ModelStats.from_address(self.lib.dpuf_model_stats_mirror(handle))
        out = ModelStats()
        ctypes.memmove(ctypes.byref(out), ctypes.byref(mirror), ctypes.sizeof(ModelStats))
        return out


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step as the core chose it: works as (entry, start, count, sample) rows,
    the entries admitted and preempted, the channels whose ring held a sequence
    out, and the free blocks after it."""

    works: np.ndarray  # [n, 4] int32
    admitted: list[int]
    preempted: list[int]
    held: int
    free_blocks: int


class HostSchedCore:
    """``sched_core.h`` on the host, on state it owns (``sched_host.c``)."""

    def __init__(self, library: Path, config: SchedConfig) -> None:
        vp, i32, i64, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
        p32 = ctypes.POINTER(ctypes.c_int32)
        signatures = {
            "dpuf_sched_host_new": ((ctypes.POINTER(SchedConfig),), vp),
            "dpuf_sched_host_free": ((vp,), None),
            "dpuf_sched_host_add_graph": ((vp, i32, i32, i32, i32, u64), i32),
            "dpuf_sched_host_inputs": ((vp, i32), vp),
            "dpuf_sched_host_add": ((vp, i64, i32, i64, i32), i32),
            "dpuf_sched_host_finish": ((vp, i32), ctypes.c_int),
            "dpuf_sched_host_set_credit": ((vp, i32, i64), None),
            "dpuf_sched_host_schedule": ((vp,), None),
            "dpuf_sched_host_schedule_serial": ((vp,), None),
            "dpuf_sched_host_spread_steps": ((vp,), i64),
            "dpuf_sched_host_commit": ((vp,), u64),
            "dpuf_sched_host_graph_for": ((vp,), i32),
            "dpuf_sched_host_fill": ((vp, i32), i32),
            "dpuf_sched_host_batch": ((vp, p32, p32, p32, p32), u64),
            "dpuf_sched_host_seq": ((vp, i32, ctypes.POINTER(SeqState), p32), i32),
        }
        lib = bind(library, signatures, "the scheduler core's host build")
        self._lib = lib
        self.config = config
        self._handle = lib.dpuf_sched_host_new(ctypes.byref(config))
        if not self._handle:
            raise MemoryError("the scheduler's state")
        self.max_blocks = -(-config.max_model_len // config.block_size)
        self._sizes: list[int] = []

    @classmethod
    def build(cls, build_dir: Path, config: SchedConfig) -> HostSchedCore:
        return cls(build_host(build_dir, SCHED_HOST), config)

    def close(self) -> None:
        if self._handle:
            self._lib.dpuf_sched_host_free(self._handle)
            self._handle = None

    def add_graph(self, tokens: int, seqs: int, tiles: int, samples: int | None,
                  nbytes: int) -> int:
        """A captured graph's sizes (``metadata.GraphShape``'s) and its input buffer's."""
        g = int(self._lib.dpuf_sched_host_add_graph(
            self._handle, tokens, seqs, tiles, -1 if samples is None else samples, nbytes))
        if g < 0:
            raise ValueError(f"more than {MAX_GRAPHS} graphs")
        self._sizes.append(nbytes)
        return g

    def add(self, seq_id: int, prompt_len: int, max_tokens: int, channel: int = -1) -> int:
        return int(self._lib.dpuf_sched_host_add(self._handle, seq_id, prompt_len, max_tokens,
                                                 channel))

    def finish(self, entry: int) -> int:
        return int(self._lib.dpuf_sched_host_finish(self._handle, entry))

    def set_credit(self, channel: int, left: int) -> None:
        self._lib.dpuf_sched_host_set_credit(self._handle, channel, left)

    def schedule(self, *, serial: bool = False) -> StepBatch:
        """The next step's batch, as the kernel schedules it (its decodes spread over
        threads where the step allows, ``dpuf_sched_schedule_spread``), or ``serial``:
        by the one-thread loop alone (``dpuf_sched_schedule``)."""
        if serial:
            self._lib.dpuf_sched_host_schedule_serial(self._handle)
        else:
            self._lib.dpuf_sched_host_schedule(self._handle)
        c = self.config
        counts = np.zeros(4, np.int32)
        works = np.zeros((c.max_seqs, 4), np.int32)
        admitted = np.zeros(c.max_seqs, np.int32)
        preempted = np.zeros(c.capacity, np.int32)

        def ptr(a: np.ndarray) -> ctypes._Pointer[ctypes.c_int32]:
            return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))

        held = int(self._lib.dpuf_sched_host_batch(self._handle, ptr(counts), ptr(works),
                                                   ptr(admitted), ptr(preempted)))
        n, a, p, free = (int(x) for x in counts)
        return StepBatch(works[:n].copy(), admitted[:a].tolist(), preempted[:p].tolist(), held,
                         free)

    @property
    def spread_steps(self) -> int:
        """Steps with decodes that were scheduled spread (not by the serial loop)."""
        return int(self._lib.dpuf_sched_host_spread_steps(self._handle))

    def commit(self) -> int:
        """The step ran; returns its KV positions read (``dpuf_sched_commit``'s)."""
        return int(self._lib.dpuf_sched_host_commit(self._handle))

    def graph_for(self) -> int:
        return int(self._lib.dpuf_sched_host_graph_for(self._handle))

    def fill(self, graph: int) -> np.ndarray:
        """The step's metadata written into graph ``graph``'s inputs: their bytes."""
        self._lib.dpuf_sched_host_fill(self._handle, graph)
        address = self._lib.dpuf_sched_host_inputs(self._handle, graph)
        return np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_uint8)),
                                     (self._sizes[graph],)).copy()

    def seq(self, entry: int) -> tuple[SeqState, list[int]]:
        state = SeqState()
        blocks = np.zeros(self.max_blocks, np.int32)
        n = self._lib.dpuf_sched_host_seq(self._handle, entry, ctypes.byref(state),
                                          blocks.ctypes.data_as(ctypes.POINTER(ctypes.c_int32)))
        return state, blocks[:n].tolist()
