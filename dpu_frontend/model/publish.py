"""The model's response records, written by the GPU at the end of each step.

The engine's sampler leaves a step's tokens (and log probabilities) in GPU
memory; the record writer (``dpu_frontend/model/device/record_writer.cu``), launched
on the same stream right after it, judges each sequence's stop rules and
publishes one response record per sequence into the ring region. The host
schedules and tells the writer, with each launch, what changed since the
last one (record_writer.h): channels reset, finals (cancelled or refused
requests: a record with no token), slots armed (a sequence admitted: where
its records go, its stop rules), and the step's rows (slot, token count).

``RingRecords`` is the host's half: it queues those operations, and it keeps
every record a free slot. A launch's records of a channel are at most its
finals and rows there; the host bounds the positions in use by what the
writer reported (its mirror) plus what launches not yet done may add, and
lets a sequence sample only while its channel's ring has room for that
bound (``room``): a DPU that stops reading holds its own channel's
sequences, never the others'.

``HostRecordBackend`` does in Python, on the region's memory, exactly what
the kernel does: the CPU tests run the engine against it, and the GPU tests
check the kernel's bytes against it.
"""

from __future__ import annotations

import ctypes
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.library import CudaLibrary, Signature
from dpu_frontend.ring.layout import (
    CHANNEL_SIZE,
    DPU_CTRL_STRUCT,
    GPU_CTRL_STRUCT,
    HEADER_SIZE,
    ChannelLayout,
    Layout,
)
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.ring.records import (
    FinishReason,
    ResponseRecord,
    SamplingParams,
    TokenLogprobs,
    encode_response_body,
)

if TYPE_CHECKING:
    from pathlib import Path

#: Operation widths in int64 words (record_writer.h).
RESET_WORDS, FINAL_WORDS, ARM_WORDS, ROW_WORDS = 2, 5, 16, 2
IGNORE_EOS, LOGPROBS = 1 << 0, 1 << 1
#: Errors the writer reports per channel.
WRITER_ERRORS = {1: "a record found no free response slot", 2: "a row wanted log "
                 "probabilities its step did not compute", 3: "an operation named a slot or "
                 "channel out of range"}
MAX_CHANNELS = 64
MAX_EOS = 8
_RESP_CONSUMED = DPU_CTRL_STRUCT.offset("resp_consumed")
_RESP_PRODUCED = GPU_CTRL_STRUCT.offset("resp_produced")


@dataclass(frozen=True, slots=True)
class Target:
    """Where a sequence's records go: a channel of the peer, and the DPU's request id."""

    channel: int
    request_id: int


@dataclass(slots=True)
class Tally:
    """What the writer reports per channel (``dpuf_writer_channel``)."""

    reserved: int = 0  # positions used this attachment: resp_produced
    published: int = 0
    tokens: int = 0
    completed: int = 0
    cancelled: int = 0
    epoch: int = 0
    error: int = 0


class StepTokens(Protocol):
    """A step's drawn tokens where the sampler left them: torch tensors on the GPU
    (``sampler.Drawn``) or NumPy arrays (the CPU tests' stand-in)."""

    tokens: Any
    logprob: Any
    top_ids: Any
    top_logprobs: Any


class Done(Protocol):
    def query(self) -> bool: ...
    def synchronize(self) -> None: ...


class RecordBackend(Protocol):
    """Runs the writer's launches (the CUDA kernel, or its Python twin)."""

    def launch(self, ops: np.ndarray, counts: tuple[int, int, int, int],
               drawn: StepTokens | None) -> Done: ...
    def tallies(self) -> list[Tally]: ...
    def close(self) -> None: ...


class _Finished:
    """A launch that ran to its end before ``launch`` returned."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None


@dataclass(slots=True)
class _Launch:
    done: Done
    potential: np.ndarray  # records it may publish, per channel
    keep: object = None  # device buffers the launch reads


@dataclass(slots=True)
class _Ops:
    resets: list[tuple[int, int]] = field(default_factory=list)
    finals: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    arms: list[list[int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.resets or self.finals or self.arms)


class RingRecords:
    """The host's half of the record writer (see the module's docstring)."""

    def __init__(self, backend: RecordBackend, layout: Layout, memory: AtomicMemory,
                 slots: int) -> None:
        self.backend = backend
        self.layout = layout
        self.memory = memory
        self._channels = len(layout.channels)
        self._slot_channel = np.zeros(slots, np.int64)
        self._ops = _Ops()
        self._unlanded: deque[_Launch] = deque()
        #: Steps in which a channel's ring had no room for one of its sequences.
        self.ring_full_waits = [0] * self._channels

    # -- what the host says ---------------------------------------------------------

    def arm(self, slot: int, target: Target, limit: int, params: SamplingParams,
            top: int) -> None:
        """``slot`` now holds ``target``'s sequence: ``limit`` tokens (prompt and
        output) end it with ``length``; ``top`` alternatives with each token's log
        probability (the request asked for log probabilities: ``top`` >= 0)."""
        stops = list(params.stop_token_ids)
        flags = (IGNORE_EOS if params.ignore_eos else 0) | (LOGPROBS if top >= 0 else 0)
        self._ops.arms.append([slot, target.channel, target.request_id, limit, flags,
                               max(top, 0), len(stops), 0, *stops, *[0] * (8 - len(stops))])
        self._slot_channel[slot] = target.channel

    def final(self, slot: int, target: Target, finish: FinishReason) -> None:
        """End ``target`` with a record of no token. ``slot`` >= 0: only if that slot
        still holds it (its own last record may have been written first)."""
        arms = self._ops.arms
        for i, arm in enumerate(arms):
            if arm[:3] == [slot, target.channel, target.request_id]:
                # Armed, not yet launched (finals run before arms): never armed at all.
                del arms[i]
                slot = -1
                break
        self._ops.finals.append((slot, target.channel, target.request_id, int(finish), 0))

    def reset(self, channel: int, epoch: int) -> None:
        """The channel attached at ``epoch`` (or detached: its epoch unchanged). The
        caller drained the GPU (``drain``) before zeroing the ring; what was queued for
        the old attachment is dropped."""
        self._ops.finals = [f for f in self._ops.finals if f[1] != channel]
        self._ops.resets.append((channel, epoch))

    @property
    def pending(self) -> bool:
        """Operations wait for a launch."""
        return bool(self._ops)

    # -- room -----------------------------------------------------------------------

    def room(self) -> list[int]:
        """Per channel, the records the next launch may add: the ring's free slots
        less every position taken or possibly taken, less the queued finals."""
        tallies = self._retire()
        taken = np.zeros(self._channels, np.int64)
        for launch in self._unlanded:
            taken += launch.potential
        restarting = {channel for channel, _ in self._ops.resets}
        out = []
        for c, ch in enumerate(self.layout.channels):
            consumed = self.memory.load_acquire(ch.dpu_ctrl_offset + _RESP_CONSUMED)
            finals = sum(1 for f in self._ops.finals if f[1] == c)
            # A reset waiting for the next launch restarts the channel at position 0.
            used = 0 if c in restarting else tallies[c].reserved + int(taken[c])
            out.append(consumed + ch.resp_slots - used - finals)
        return out

    def held(self, channel: int) -> None:
        self.ring_full_waits[channel] += 1

    # -- launches -------------------------------------------------------------------

    def launch(self, rows: np.ndarray, drawn: StepTokens | None) -> None:
        """Queue the writer behind a step: ``rows`` [n, 2] (slot, total) in the
        sampler's order, ``drawn`` its tokens; with the operations said since the last
        launch. ``rows`` may be empty (operations alone)."""
        ops, self._ops = self._ops, _Ops()
        potential = np.zeros(self._channels, np.int64)
        if len(rows):
            slots = rows[:, 0]
            potential += np.bincount(self._slot_channel[slots[slots >= 0]],
                                     minlength=self._channels)
        for f in ops.finals:
            potential[f[1]] += 1
        parts = [np.asarray(ops.resets, np.int64).reshape(-1),
                 np.asarray(ops.finals, np.int64).reshape(-1),
                 np.asarray(ops.arms, np.int64).reshape(-1),
                 np.asarray(rows, np.int64).reshape(-1)]
        flat = np.concatenate(parts) if any(len(p) for p in parts) else np.zeros(0, np.int64)
        counts = (len(ops.resets), len(ops.finals), len(ops.arms), len(rows))
        done = self.backend.launch(flat, counts, drawn)
        self._unlanded.append(_Launch(done, potential, drawn))

    def flush(self) -> None:
        """Launch the queued operations alone (the engine has no step to carry them)."""
        if self._ops:
            self.launch(np.zeros((0, 2), np.int64), None)

    def drain(self) -> None:
        """Wait for every launch (before the host zeroes a channel's ring)."""
        while self._unlanded:
            self._unlanded[0].done.synchronize()
            self._retire()

    def _retire(self) -> list[Tally]:
        """Forget the launches that are done; the writer's counters as they stand
        (an error it reported fails the caller)."""
        while self._unlanded and self._unlanded[0].done.query():
            self._unlanded.popleft()
        tallies = self.backend.tallies()
        for c, tally in enumerate(tallies):
            if tally.error:
                raise RuntimeError(f"record writer, channel {c}: "
                                   f"{WRITER_ERRORS.get(tally.error, tally.error)}")
        return tallies

    def tally(self, channel: int) -> Tally:
        return self.backend.tallies()[channel]

    def close(self) -> None:
        self.drain()
        self.backend.close()


def channel_table(layout: Layout) -> bytes:
    """The layout's ``dpuf_channel_desc`` array, as the writer takes it."""
    data = layout.encode()
    return data[HEADER_SIZE:HEADER_SIZE + CHANNEL_SIZE * len(layout.channels)]


# -- the writer in Python: the kernel's twin --------------------------------------------


@dataclass(slots=True)
class _Slot:
    request_id: int = 0
    state: int = 0  # 0 free, 1 active, 2 done
    channel: int = 0
    limit: int = 0
    flags: int = 0
    top: int = 0
    stops: tuple[int, ...] = ()


class HostRecordBackend:
    """record_writer.cu's phases, one after the other, on the region's memory."""

    def __init__(self, layout: Layout, memory: AtomicMemory, slots: int,
                 eos: tuple[int, ...]) -> None:
        self.layout = layout
        self.memory = memory
        self.eos = frozenset(eos)
        self._slots = [_Slot() for _ in range(slots)]
        self._tallies = [Tally() for _ in layout.channels]

    def tallies(self) -> list[Tally]:
        return self._tallies

    def close(self) -> None:
        return None

    def launch(self, ops: np.ndarray, counts: tuple[int, int, int, int],
               drawn: StepTokens | None) -> Done:
        n_resets, n_finals, n_arms, n_rows = counts
        at = 0

        def take(n: int, width: int) -> list[list[int]]:
            nonlocal at
            out = ops[at:at + n * width].reshape(n, width).tolist() if n else []
            at += n * width
            return out

        resets, finals = take(n_resets, RESET_WORDS), take(n_finals, FINAL_WORDS)
        arms, rows = take(n_arms, ARM_WORDS), take(n_rows, ROW_WORDS)
        for c, epoch in resets:
            self._tallies[c].reserved = 0
            self._tallies[c].epoch = epoch
            for s in self._slots:
                if s.state == 1 and s.channel == c:
                    s.state = 2
        consumed = [self.memory.load_acquire(ch.dpu_ctrl_offset + _RESP_CONSUMED)
                    for ch in self.layout.channels]
        before = [t.reserved for t in self._tallies]
        for slot, c, request_id, finish, _flags in finals:
            if slot >= 0:
                s = self._slots[slot]
                if not (s.state == 1 and s.channel == c and s.request_id == request_id):
                    continue
                s.state = 2
            cancelled = finish == FinishReason.CANCELLED
            self._publish(c, consumed, ResponseRecord(request_id, (), FinishReason(finish)),
                          0, cancelled)
        for arm in arms:
            slot, c, request_id, limit, flags, top, n_stop = arm[:7]
            self._slots[slot] = _Slot(request_id, 1, c, limit, flags, top,
                                      tuple(arm[8:8 + n_stop]))
        if n_rows:
            if drawn is None:
                raise ValueError("rows without their tokens")
            self._rows(rows, drawn, consumed)
        for c, ch in enumerate(self.layout.channels):
            if self._tallies[c].reserved != before[c] or resets:
                self.memory.store_release(ch.gpu_ctrl_offset + _RESP_PRODUCED,
                                          self._tallies[c].reserved)
        return _Finished()

    def _rows(self, rows: list[list[int]], drawn: StepTokens, consumed: list[int]) -> None:
        tokens = np.asarray(drawn.tokens).tolist()
        logprob = None if drawn.logprob is None else np.asarray(drawn.logprob, np.float32)
        top_ids = None if drawn.top_ids is None else np.asarray(drawn.top_ids)
        top_lps = None if drawn.top_logprobs is None else np.asarray(drawn.top_logprobs,
                                                                     np.float32)
        for i, (slot, total) in enumerate(rows):
            if slot < 0:
                continue  # a row with no record
            s = self._slots[slot]
            if s.state != 1:
                continue
            token = tokens[i]
            stop = (token in self.eos and not s.flags & IGNORE_EOS) or token in s.stops
            finish = (FinishReason.STOP if stop else FinishReason.LENGTH if total >= s.limit
                      else FinishReason.NONE)
            entries: tuple[TokenLogprobs, ...] | None = None
            if s.flags & LOGPROBS:
                if stop:
                    entries = ()
                else:
                    if logprob is None or (s.top and top_ids is None):
                        self._tallies[s.channel].error = self._tallies[s.channel].error or 2
                        continue
                    top = tuple((int(top_ids[i][k]), float(top_lps[i][k]))  # type: ignore[index]
                                for k in range(s.top))
                    entries = (TokenLogprobs(float(logprob[i]), top),)
            if finish is not FinishReason.NONE:
                s.state = 2
            record = ResponseRecord(s.request_id, () if stop else (token,), finish, entries)
            self._publish(s.channel, consumed, record, 0 if stop else 1, False)

    def _publish(self, c: int, consumed: list[int], record: ResponseRecord, n: int,
                 cancelled: bool) -> None:
        ch: ChannelLayout = self.layout.channels[c]
        tally = self._tallies[c]
        p = tally.reserved
        if p - consumed[c] >= ch.resp_slots:
            tally.error = tally.error or 1
            return
        tally.reserved += 1
        slot = ch.resp_slot_offset(p)
        self.memory.write(slot + 8, encode_response_body(record, ch.resp_slot_size, tally.epoch))
        self.memory.store_release(slot, p + 1)
        tally.published += 1
        tally.tokens += n
        if cancelled:
            tally.cancelled += 1
        elif record.finish is not FinishReason.NONE:
            tally.completed += 1


# -- the writer on the GPU ---------------------------------------------------------------


class WriterParams(ctypes.Structure):
    """Mirror of ``dpuf_writer_params`` (CI checks every offset against the header)."""

    _fields_ = (
        ("region", ctypes.c_void_p),
        ("region_size", ctypes.c_uint64),
        ("channels", ctypes.c_char_p),
        ("channel_count", ctypes.c_uint32),
        ("slots", ctypes.c_uint32),
        ("eos", ctypes.c_uint32 * MAX_EOS),
        ("eos_count", ctypes.c_uint32),
        ("device", ctypes.c_int32),
        ("region_is_device", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    )


class WriterChannel(ctypes.Structure):
    """Mirror of ``dpuf_writer_channel``."""

    _fields_ = (
        ("reserved", ctypes.c_uint64),
        ("published", ctypes.c_uint64),
        ("tokens", ctypes.c_uint64),
        ("completed", ctypes.c_uint64),
        ("cancelled", ctypes.c_uint64),
        ("epoch", ctypes.c_uint32),
        ("error", ctypes.c_uint32),
        ("pad", ctypes.c_uint8 * 16),
    )


class WriterLibrary(CudaLibrary):
    """``libdpuf_records.so`` (record_writer.h)."""

    what = "the record writer library"
    last_error = "dpuf_writer_last_error"

    @classmethod
    def api(cls) -> dict[str, Signature]:
        vp, u32, u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint64
        return {**super().api(),
                "dpuf_writer_create": ((ctypes.POINTER(WriterParams),), vp),
                "dpuf_writer_mirror": ((vp,), ctypes.POINTER(WriterChannel)),
                "dpuf_writer_launch": ((vp, u64, vp, u32, u32, u32, u32, vp, vp, vp, vp, u32),
                                       ctypes.c_int),
                "dpuf_writer_destroy": ((vp,), None)}


@dataclass(slots=True)
class _EventDone:
    event: Any  # torch.cuda.Event, recorded behind the launch
    keep: object  # the buffers it reads, alive until it is done

    def query(self) -> bool:
        return bool(self.event.query())

    def synchronize(self) -> None:
        self.event.synchronize()


class CudaRecordBackend:
    """``libdpuf_records.so``: the kernel, launched on the current torch stream."""

    def __init__(self, library: Path, layout: Layout, memory: AtomicMemory, slots: int,
                 eos: tuple[int, ...], device: int) -> None:
        import torch  # the GPU side only

        if len(layout.channels) > MAX_CHANNELS or len(eos) > MAX_EOS:
            raise StartupError(f"the record writer takes at most {MAX_CHANNELS} channels and "
                               f"{MAX_EOS} EOS ids")
        self._torch = torch
        self._lib = WriterLibrary.load(library)
        table = channel_table(layout)
        params = WriterParams(region=memory.address, region_size=len(memory),
                              channels=table, channel_count=len(layout.channels), slots=slots,
                              eos_count=len(eos), device=device)
        for i, t in enumerate(eos):
            params.eos[i] = t
        handle = self._lib.lib.dpuf_writer_create(ctypes.byref(params))
        if not handle:
            raise StartupError(f"record writer: {self._lib.error()}")
        self._handle: int | None = handle
        self._mirror = self._lib.lib.dpuf_writer_mirror(handle)
        self._count = len(layout.channels)
        self._device = torch.device("cuda", device)

    def tallies(self) -> list[Tally]:
        return [Tally(m.reserved, m.published, m.tokens, m.completed, m.cancelled, m.epoch,
                      m.error) for m in self._mirror[:self._count]]

    def launch(self, ops: np.ndarray, counts: tuple[int, int, int, int],
               drawn: StepTokens | None) -> Done:
        from dpu_frontend.model.layers.sampler import to_device

        torch = self._torch
        device_ops = to_device(torch.from_numpy(ops), self._device) if len(ops) else None

        def ptr(t: Any) -> int | None:
            return None if t is None else int(t.data_ptr())

        stride = 0
        tokens = logprob = top_ids = top_lps = None
        if drawn is not None:
            tokens, logprob = drawn.tokens, drawn.logprob
            top_ids, top_lps = drawn.top_ids, drawn.top_logprobs
            if top_ids is not None:
                top_ids, top_lps = top_ids.contiguous(), top_lps.contiguous()
                stride = int(top_ids.shape[1])
        stream = torch.cuda.current_stream(self._device).cuda_stream
        rc = self._lib.lib.dpuf_writer_launch(self._handle, stream, ptr(device_ops), *counts,
                                          ptr(tokens), ptr(logprob), ptr(top_ids), ptr(top_lps),
                                          stride)
        if rc != 0:
            raise RuntimeError(f"record writer launch: {self._lib.error()}")
        event = torch.cuda.Event()
        event.record()
        return _EventDone(event, (device_ops, tokens, logprob, top_ids, top_lps))

    def close(self) -> None:
        if self._handle is not None:
            self._lib.lib.dpuf_writer_destroy(self._handle)
            self._handle = None
