"""Tensor parallelism's step relay in C (``step_relay.h``): rank 0's scheduler hands each
step (its graph and its bytes) to the other ranks through two boxes each in their
memory, and a follower gives a box back once it has taken the step out. Built for the
host with the ranks as threads (``HostRelay``), which the tests hold to the steps the
leader sent, in order and byte for byte, and to its fault when a follower stalls."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dpu_frontend.gpu.library import bind
from dpu_frontend.gpu.runtime import STEP_RELAY_HOST, build_host

#: step_relay.h's DPUF_RELAY_MAX_FOLLOWERS, its kinds and DPUF_RELAY_FAULT.
MAX_FOLLOWERS = 7
STEP, STOP = 1, 2
FAULT = 0x4000_0000


class Header(ctypes.Structure):
    """Mirror of ``dpuf_relay_header``."""

    _fields_ = (("seq", ctypes.c_uint32), ("kind", ctypes.c_uint32), ("graph", ctypes.c_int32),
                ("bytes", ctypes.c_uint32))


@dataclass(frozen=True)
class Step:
    """A step as a rank holds it: its number, kind, graph and payload."""

    seq: int
    kind: int
    graph: int
    payload: bytes


@dataclass(frozen=True)
class RelayRun:
    """What each follower took (its steps, in the order taken) and the leader's fault."""

    taken: list[list[Step]]
    fault: str | None


def describe_fault(word: int) -> str | None:
    if not word:
        return None
    if not word & FAULT:
        return f"the step relay's fault word holds {word:#x}, no fault it raises"
    return (f"the step relay's leader found follower {word & 0xFF}'s box still full past its "
            "patience: that rank's kernel takes no steps")


class HostRelay:
    """The relay's host build: a leader and ``followers`` followers on threads of their
    own, boxes of ``capacity`` payload bytes (a multiple of 16)."""

    def __init__(self, library: Path, followers: int, capacity: int) -> None:
        if not 1 <= followers <= MAX_FOLLOWERS or capacity < 16 or capacity % 16:
            raise ValueError(f"{followers} followers (1 to {MAX_FOLLOWERS}), a capacity of "
                             f"{capacity} bytes (a multiple of 16)")
        vp, i32, u32, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint64
        self._lib = bind(library, {
            "dpuf_relay_host_run": ((i32, u64, u32, vp, vp, vp, vp, vp, vp, u64, i32, u32, u32,
                                     vp), ctypes.c_int),
        }, "the step relay's host build")
        self.followers, self.capacity = followers, capacity

    @classmethod
    def build(cls, build_dir: Path, followers: int, capacity: int) -> HostRelay:
        return cls(build_host(build_dir, STEP_RELAY_HOST), followers, capacity)

    def run(self, steps: Sequence[tuple[int, bytes]], *, patience_s: float = 10.0,
            stalled: int = 0, stall_after: int = 0, seed: int = 0) -> RelayRun:
        """``steps`` (graph, payload) sent by the leader, the last one as the STOP;
        follower ``stalled`` (0: none) takes none past ``stall_after``; every rank pauses
        at random by ``seed`` (0: never)."""
        n, cap = len(steps), self.capacity
        if any(len(payload) > self.capacity for _, payload in steps):
            raise ValueError(f"a payload past the boxes' {self.capacity} bytes")
        payloads = ctypes.create_string_buffer(b"".join(p.ljust(cap, b"\0") for _, p in steps)
                                               or b"\0")
        sizes = (ctypes.c_uint32 * max(1, n))(*(len(p) for _, p in steps))
        graphs = (ctypes.c_int32 * max(1, n))(*(g for g, _ in steps))
        received = ctypes.create_string_buffer(max(1, self.followers * n * cap))
        headers = (Header * max(1, self.followers * n))()
        taken = (ctypes.c_int32 * self.followers)()
        fault = ctypes.c_uint32()
        rc = self._lib.dpuf_relay_host_run(
            self.followers, self.capacity, n, payloads, sizes, graphs, received, headers, taken,
            int(patience_s * 1e9), stalled, stall_after, seed, ctypes.byref(fault))
        if rc in (-1, -3):
            raise ValueError("the step relay's host build refused the run")
        raw = received.raw
        out = []
        for f in range(self.followers):
            steps_f = []
            for s in range(taken[f]):
                h = headers[f * n + s]
                at = (f * n + s) * cap
                steps_f.append(Step(h.seq, h.kind, h.graph, raw[at:at + h.bytes]))
            out.append(steps_f)
        return RelayRun(out, describe_fault(fault.value))
