# Triton kernels' parameters are typed by the JIT (pointers, constexprs), not by hints.
# mypy: disable-error-code="no-untyped-def, untyped-decorator"
"""Programmatic dependent launch (Hopper and later): a kernel's programs start while the
kernel before it in the stream finishes, and wait for its results inside.

A decode step at a small batch is some 300 kernels of a few microseconds each (nine a
layer), and each one's launch and ramp sat between two others. Launched with
``launch_pdl``, a kernel may begin once every program of the kernel before it has
signalled (``gdc_launch_dependents``) or exited; its programs then wait
(``gdc_wait``, their first statement) until that kernel has completed and its writes
are visible, so results are ordered as the stream orders them. What overlaps is the
next launch and its programs' placement, never two kernels' arithmetic.

Where the signal goes matters. A kernel whose grid fits the GPU at once (a program a
multiprocessor or fewer) signals at its start: its successor's programs are placed in
the room left beside it. A wider kernel signals only as its programs exit: signalled
early, its successor's programs would be placed wherever its own leave first, two or
three to some multiprocessors and none to others, and a one-wave, memory-bound
successor then streams its weight through half the GPU (measured: Qwen3-8B's step at
batch 1 went from 5.16 to 5.94 ms on an H200). For the same reason the persistent TMA
linear (a program a multiprocessor, each walking its tiles) is launched without the
attribute: it starts once its predecessor has completed, spread evenly.

A kernel after one without the attribute (torch's), or after a copy, waits as any
launch does. CUDA graphs keep the dependency as a programmatic edge, and graphs with
such edges launch from the device (``../shared/GPU.md``), so the GPU scheduler's step
graphs carry it too.

``DPU_FRONTEND_PDL=0`` launches every kernel as before (the A/B of the benchmarks, and a
way back should a driver misbehave); the interpreter (``TRITON_INTERPRET=1``) and GPUs
before compute capability 9 never use it.
"""

from __future__ import annotations

import math
import os
from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def dependent_start(PDL: tl.constexpr, EARLY: tl.constexpr):
    """A kernel's first statement: wait for the kernel before it; ``EARLY``, then let the
    next one launch (else it launches as this one's programs exit)."""
    if PDL:
        gdc_wait()
        if EARLY:
            gdc_launch_dependents()


@cache
def _enabled(device: int) -> bool:
    if os.environ.get("DPU_FRONTEND_PDL", "1") == "0" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return (torch.version.hip is None and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device)[0] >= 9)


@cache
def multiprocessors(device: int) -> int:
    """The streaming multiprocessors of CUDA device ``device``."""
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def launch(device: torch.device, grid: tuple[int, ...], *,
           persistent: bool = False) -> dict[str, bool]:
    """The launch arguments of a kernel that starts with ``dependent_start``, on
    ``device`` with ``grid``: its ``PDL`` and ``EARLY`` constexprs and Triton's
    ``launch_pdl``. ``persistent``: a grid of a program a multiprocessor, launched
    without the attribute."""
    index = device.index or 0
    on = device.type == "cuda" and _enabled(index) and not persistent
    early = on and math.prod(grid) <= multiprocessors(index)
    return {"PDL": on, "EARLY": early, "launch_pdl": on}
