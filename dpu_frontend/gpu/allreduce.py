"""Tensor parallelism's all-reduce over peer memory in C (``allreduce.h``): built for
the host with the ranks' blocks as threads (``HostAllReduce``), which the tests hold
bit for bit to the rank-order sum of ``model.layers.collective.sum_in_rank_order``;
and for the GPU (``allreduce.cu``, bound by ``PeerMemoryLibrary``), the kernel that
``model.layers.collective.PeerMemoryGroup`` runs over NVLink. A wait past the
patience raises the rank's fault word (``describe_fault`` reads it)."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.library import CudaLibrary, Signature, bind
from dpu_frontend.gpu.runtime import ALLREDUCE_HOST, build_host

#: allreduce.h's dtypes, by their width in bytes: float32 and bfloat16.
DTYPES = {"float32": (0, 4), "bfloat16": (1, 2)}
#: allreduce.h's DPUF_AR_MAX_RANKS, DPUF_AR_PHASES and DPUF_AR_FAULT.
MAX_RANKS = 8
PHASES = 3
FAULT = 0x8000_0000
PHASE_NAMES = ("READY", "MID", "DONE")
#: How long a rank waits for a peer's flag before it takes the peer for stalled: well
#: past any step's time, and past a peer compiling a kernel while this one waits.
PATIENCE_S = 60.0


def describe_fault(rank: int, word: int) -> str | None:
    """Rank ``rank``'s fault word in words; None for none."""
    if not word:
        return None
    if not word & FAULT or (word >> 8) & 0xFF >= PHASES:
        return f"rank {rank}'s all-reduce fault word holds {word:#x}, no fault it raises"
    return (f"rank {rank}'s all-reduce waited past its patience for rank {word & 0xFF} "
            f"at {PHASE_NAMES[(word >> 8) & 0xFF]}: that rank's kernel stopped or stalls")


class Stalled(RuntimeError):
    """A call in which some rank waited past its patience: the ranks' faults (None where
    a rank has none)."""

    def __init__(self, faults: list[str | None]) -> None:
        super().__init__("; ".join(f for f in faults if f))
        self.faults = faults


class HostAllReduce:
    """``ranks`` ranks' buffers of ``n`` elements of ``dtype`` in host memory, and the
    flags they signal through, kept from call to call as a GPU's are; each call sums
    every rank's input in ``blocks`` blocks, one-shot or two-shot."""

    def __init__(self, library: Path, ranks: int, n: int, dtype: str, blocks: int,
                 patience_s: float = 10.0) -> None:
        if not 1 <= ranks <= MAX_RANKS or n < 0 or blocks < 1 or dtype not in DTYPES:
            raise ValueError(f"{ranks} ranks (1 to {MAX_RANKS}), {n} elements, {blocks} "
                             f"blocks, dtype {dtype} (one of {sorted(DTYPES)})")
        vp, i32, i64, u32, u64 = (ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64,
                                  ctypes.c_uint32, ctypes.c_uint64)
        self._lib = bind(library, {
            "dpuf_ar_host_run": ((i32, i32, i32, i64, i32, u32, vp, vp, vp, vp, u64, i32),
                                 ctypes.c_int),
            "dpuf_ar_host_stream": ((i32, i32, i64, i32, i32, vp, vp, u32, u64), ctypes.c_int),
        }, "the all-reduce's host build")
        self.ranks, self.n, self.blocks = ranks, n, blocks
        self.patience_ns = int(patience_s * 1e9)
        self._code, self.itemsize = DTYPES[dtype]
        self._bufs = [ctypes.create_string_buffer(max(1, n * self.itemsize)) for _ in range(ranks)]
        self._outs = [ctypes.create_string_buffer(max(1, n * self.itemsize)) for _ in range(ranks)]
        self._flags = [(ctypes.c_uint32 * (PHASES * blocks * ranks))() for _ in range(ranks)]
        self._faults = (ctypes.c_uint32 * ranks)()
        self._epoch = 0

    @classmethod
    def build(cls, build_dir: Path, ranks: int, n: int, dtype: str, blocks: int,
              patience_s: float = 10.0) -> HostAllReduce:
        return cls(build_host(build_dir, ALLREDUCE_HOST), ranks, n, dtype, blocks, patience_s)

    def faults(self) -> list[str | None]:
        """Each rank's fault, kept from call to call as a GPU's word is."""
        return [describe_fault(r, int(w)) for r, w in enumerate(self._faults)]

    def _check(self, rc: int, faults: list[str | None]) -> None:
        if rc == -2:
            raise Stalled(faults)
        if rc != 0:
            raise ValueError("the all-reduce's host build refused the call")

    def __call__(self, inputs: Sequence[bytes], *, two_shot: bool,
                 absent: int | None = None) -> list[bytes]:
        """Every rank's result (the same bits on each, if the sum is right), from
        every rank's input (``n`` elements' bytes, little-endian). ``absent``: a rank
        that runs no block, as one whose kernel stopped (``Stalled`` follows)."""
        size = self.n * self.itemsize
        if len(inputs) != self.ranks or any(len(x) != size for x in inputs):
            raise ValueError(f"{self.ranks} inputs of {size} bytes")
        for buf, x in zip(self._bufs, inputs, strict=True):
            ctypes.memmove(buf, x, size)
        self._epoch = (self._epoch + 1) & 0xFFFF_FFFF
        array = ctypes.c_void_p * MAX_RANKS
        rc = self._lib.dpuf_ar_host_run(
            self.ranks, self._code, int(two_shot), self.n, self.blocks, self._epoch,
            array(*(ctypes.addressof(b) for b in self._bufs)),
            array(*(ctypes.addressof(f) for f in self._flags)),
            array(*(ctypes.addressof(o) for o in self._outs)), self._faults, self.patience_ns,
            -1 if absent is None else absent)
        self._check(rc, self.faults())
        return [o.raw[:size] for o in self._outs]

    def stream(self, calls: Sequence[Sequence[bytes]], seed: int) -> list[list[bytes]]:
        """Every call's results on every rank, ``calls[k][r]`` rank r's input to call k:
        each rank on a stream of its own (its copy, then its blocks), one-shot and
        two-shot in turn, drifting apart by ``seed``'s pauses (0: none), so that a rank
        may start a call while another still reads the last one's buffers. Its own
        buffers and flags, fresh."""
        size = self.n * self.itemsize
        if any(len(call) != self.ranks or any(len(x) != size for x in call) for call in calls):
            raise ValueError(f"each call: {self.ranks} inputs of {size} bytes")
        inputs = b"".join(x for call in calls for x in call)
        outs = ctypes.create_string_buffer(max(1, len(inputs)))
        rc = self._lib.dpuf_ar_host_stream(self.ranks, self._code, self.n, self.blocks, len(calls),
                                           inputs, outs, seed, self.patience_ns)
        self._check(rc, [f"a rank's wait in the stream passed {self.patience_ns} ns"])
        raw = outs.raw
        return [[raw[(k * self.ranks + r) * size:(k * self.ranks + r + 1) * size]
                 for r in range(self.ranks)] for k in range(len(calls))]


class PeerMemoryLibrary(CudaLibrary):
    """``libdpuf_allreduce.so`` (``allreduce.cu``): one rank's buffers and kernel."""

    what = "the all-reduce library"
    last_error = "dpuf_ar_last_error"

    @classmethod
    def api(cls) -> dict[str, Signature]:
        vp, i32, i64, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_uint64
        return {
            **super().api(),
            "dpuf_ar_create": ((i32, i32, i32, u64, i32, u64), vp),
            "dpuf_ar_fault": ((vp,), ctypes.c_uint32),
            "dpuf_ar_handle_bytes": ((), ctypes.c_int),
            "dpuf_ar_handles": ((vp, ctypes.c_char_p), ctypes.c_int),
            "dpuf_ar_open": ((vp, ctypes.c_char_p), ctypes.c_int),
            "dpuf_ar_run": ((vp, vp, vp, i64, i32, i32, vp), ctypes.c_int),
            "dpuf_ar_destroy": ((vp,), None),
        }

    def create(self, device: int, rank: int, ranks: int, max_bytes: int, blocks: int,
               patience_s: float = PATIENCE_S) -> int:
        """This rank's handle; a ``StartupError`` with the library's reason if refused."""
        handle = self.lib.dpuf_ar_create(device, rank, ranks, max_bytes, blocks,
                                         int(patience_s * 1e9))
        if not handle:
            raise StartupError(f"the all-reduce's buffers on device {device}: {self.error()}")
        return int(handle)

    def handles(self, handle: int) -> bytes:
        """This rank's IPC handles, for every other rank's ``open``."""
        out = ctypes.create_string_buffer(self.lib.dpuf_ar_handle_bytes())
        self.check(self.lib.dpuf_ar_handles(handle, out), "the all-reduce's IPC handles")
        return out.raw

    def open(self, handle: int, everyone: Sequence[bytes]) -> None:
        """Every rank's ``handles``, in rank order: the peers' buffers mapped here."""
        self.check(self.lib.dpuf_ar_open(handle, b"".join(everyone)), "the peers' buffers")

    def run(self, handle: int, src: int, dst: int, n: int, dtype: str, two_shot: bool,
            stream: int) -> None:
        """``n`` elements of ``dtype`` from device address ``src`` summed over the ranks
        into ``dst``, on ``stream`` (a CUDA graph may capture it)."""
        self.check(self.lib.dpuf_ar_run(handle, src, dst, n, DTYPES[dtype][0], int(two_shot),
                                        stream), "the all-reduce")

    def fault(self, handle: int) -> int:
        """The rank's fault word (0: none), read from host memory without a sync."""
        return int(self.lib.dpuf_ar_fault(handle))

    def destroy(self, handle: int) -> None:
        self.lib.dpuf_ar_destroy(handle)
