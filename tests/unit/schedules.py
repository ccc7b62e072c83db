"""Schedules of the two programs of ``interleave.py``, and the exploration of every point.

``schedules`` runs the lockstep schedule once to number its points, then makes
one schedule per point with the other side running there: after every GPU load
and store (another warp advances the producer index, and the DPU runs until it
has nothing left to do), and after every operation of every DPU poll (the GPU
runs a whole step before the next one). ``explore`` runs them until one fails;
``failures`` runs them all and says how each failed, for a broken half.
``everywhere`` and ``Seeded`` interleave more than one point at a time.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dpu_frontend.ring import DpuChannel, Geometry, GpuChannel

from .interleave import IDLE, World, run


def lockstep(world: World, point: int, access: str) -> None:
    """Each side takes whole turns: a DPU poll between two engine steps."""
    if access == IDLE:
        world.dpu.poll()


@dataclass(frozen=True, slots=True)
class Preempt:
    """Lockstep but at ``point``: after a GPU access, another warp advances the index and
    the DPU runs until it has nothing to do; at an IDLE point with ``ops``, the DPU
    stops after that many operations of its poll, so that a whole engine step runs
    in the middle of the poll."""

    point: int
    ops: int = 0

    def __call__(self, world: World, point: int, access: str) -> None:
        if point != self.point:
            lockstep(world, point, access)
        elif self.ops:
            world.dpu.step(self.ops)
        else:
            lockstep(world, point, access)
            world.advance()
            world.dpu.drain()


def everywhere(world: World, point: int, access: str) -> None:
    """The DPU drains after every GPU access, another warp advancing first."""
    world.advance()
    world.dpu.drain()


class Seeded:
    """At each point, with odds from ``seed``: nothing, or a few DPU operations (a poll
    cut anywhere), another warp's advance first at some."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def __repr__(self) -> str:
        return f"Seeded({self.seed})"

    def __call__(self, world: World, point: int, access: str) -> None:
        rng = self._rng
        if rng.random() < 0.2:
            world.advance()
        if access == IDLE or rng.random() < 0.4:
            world.dpu.step(rng.choice((1, 1, 2, 3, 5, 8)))


def schedules(geometry: Geometry, dpu_type: type[DpuChannel] = DpuChannel,
              gpu_type: type[GpuChannel] = GpuChannel, *, later: bool | None = None) -> list[Preempt]:
    """Every schedule ``Preempt`` makes of the lockstep run's points: all of them, only
    those of the first lap of either ring (``later=False``), or only those after both
    rings wrapped (``later=True``). The lockstep run itself must pass, and fill both
    rings."""
    base = run(geometry, lockstep, dpu_type, gpu_type)
    if not base.full_request_ring or not base.gpu.channel.counters.ring_full_waits:
        raise AssertionError("the lockstep run never filled both rings: the traffic is too light")
    out = []
    for point, turn in enumerate(base.turns):
        if later is None or turn.later == later:
            out.append(Preempt(point))
            out += [Preempt(point, ops) for ops in range(1, turn.ops)]
    return out


def explore(geometry: Geometry, dpu_type: type[DpuChannel] = DpuChannel,
            gpu_type: type[GpuChannel] = GpuChannel, *, later: bool | None = None) -> int:
    """Run every schedule of ``schedules``; the first that fails raises, with the schedule
    in a note. Returns how many ran."""
    found = schedules(geometry, dpu_type, gpu_type, later=later)
    for schedule in found:
        run(geometry, schedule, dpu_type, gpu_type)
    return len(found)


def failures(geometry: Geometry, dpu_type: type[DpuChannel] = DpuChannel,
             gpu_type: type[GpuChannel] = GpuChannel, *, later: bool | None = None) -> list[Exception]:
    """How each schedule of ``schedules`` fails: for a broken half, every failure must be
    the one that should catch it. A half that breaks the lockstep run itself raises
    here: it has no schedules to explore (the caller says whether it expected that)."""
    found = schedules(geometry, dpu_type, gpu_type, later=later)
    out = []
    for schedule in found:
        try:
            run(geometry, schedule, dpu_type, gpu_type)
        except Exception as exc:
            out.append(exc)
    return out
