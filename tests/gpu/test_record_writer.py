"""The record writer kernel against its Python twin: the same operations and tokens
give the same region, byte for byte (response rings and producer indices), and the
same counters; a record with no free slot is refused and reported, never written."""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from dpu_frontend.gpu.runtime import build, default_build_dir
from dpu_frontend.model.device import RECORDS
from dpu_frontend.model.publish import (
    CudaRecordBackend,
    HostRecordBackend,
    RingRecords,
    Target,
)
from dpu_frontend.ring import FinishReason, Geometry, Layout, SamplingParams
from dpu_frontend.ring.layout import DPU_CTRL_STRUCT
from dpu_frontend.ring.memory import AtomicMemory

pytestmark = pytest.mark.gpu

EOS = (151643, 151645)
SLOTS = 16
_CONSUMED = DPU_CTRL_STRUCT.offset("resp_consumed")


@pytest.fixture(scope="module")
def library() -> Path:
    major, minor = torch.cuda.get_device_capability()
    return build(default_build_dir(), RECORDS, arch=f"sm_{major}{minor}")


class Twins:
    """One RingRecords over the kernel, one over the Python twin, each on its own
    region of the same layout; every call goes to both."""

    def __init__(self, library: Path, layout: Layout) -> None:
        self.layout = layout
        self.maps = [mmap.mmap(-1, layout.region_size) for _ in range(2)]
        self.memories = [AtomicMemory(m) for m in self.maps]
        for memory in self.memories:
            memory.write(0, layout.encode())
        self.gpu = RingRecords(CudaRecordBackend(library, layout, self.memories[0], SLOTS, EOS, 0),
                               layout, self.memories[0], SLOTS)
        self.cpu = RingRecords(HostRecordBackend(layout, self.memories[1], SLOTS, EOS),
                               layout, self.memories[1], SLOTS)

    def both(self) -> Iterator[RingRecords]:
        yield self.gpu
        yield self.cpu

    def step(self, rows: list[tuple[int, int]], tokens: list[int], top: int = -1) -> None:
        """One launch with these rows; log probabilities made up per row when ``top`` >= 0."""
        n = len(tokens)
        t = torch.tensor(tokens, dtype=torch.int64, device="cuda")
        lp = top_ids = top_lps = None
        if top >= 0:
            lp = -torch.arange(1, n + 1, dtype=torch.float32, device="cuda") / 8
            if top > 0:
                top_ids = (t[:, None] + torch.arange(top, device="cuda")[None, :]).contiguous()
                top_lps = (lp[:, None] - torch.arange(top, device="cuda")[None, :] / 4).contiguous()
        gpu_drawn = Drawn(t, lp, top_ids, top_lps)
        cpu_drawn = Drawn(*(None if x is None else x.cpu().numpy()
                            for x in (t, lp, top_ids, top_lps)))
        r = np.array(rows, np.int64).reshape(-1, 2)
        self.gpu.launch(r, gpu_drawn)
        self.cpu.launch(r, cpu_drawn)
        self.gpu.drain()

    def consume(self, channel: int, upto: int) -> None:
        for memory in self.memories:
            memory.store_release(self.layout.channels[channel].dpu_ctrl_offset + _CONSUMED, upto)

    def assert_equal(self) -> None:
        a, b = (bytes(m) for m in self.maps)
        if a != b:
            first = next(i for i in range(len(a)) if a[i] != b[i])
            raise AssertionError(f"the regions differ first at byte {first}: "
                                 f"GPU {a[first:first + 32].hex()} Python {b[first:first + 32].hex()}")
        assert self.gpu.backend.tallies() == self.cpu.backend.tallies()


class Drawn:
    def __init__(self, tokens: object, logprob: object, top_ids: object,
                 top_logprobs: object) -> None:
        self.tokens, self.logprob, self.top_ids, self.top_logprobs = (
            tokens, logprob, top_ids, top_logprobs)


def arm(records: RingRecords, slot: int, channel: int, request_id: int, limit: int,
        top: int = -1, **params: object) -> None:
    records.arm(slot, Target(channel, request_id), limit,
                SamplingParams(max_tokens=16, **params), top)  # type: ignore[arg-type]


def test_the_kernel_writes_what_its_python_twin_writes(library: Path) -> None:
    layout = Geometry(channels=2, req_slots=16, arena_bytes=4096, resp_slots=32,
                      max_sequences=16).plan(instance=3)
    twins = Twins(library, layout)
    for r in twins.both():
        r.reset(0, 1)
        r.reset(1, 1)
        arm(r, 0, 0, 100, limit=5)  # prompt 2 + 3 tokens
        arm(r, 1, 1, 101, limit=50, stop_token_ids=(7, 9))
        arm(r, 2, 0, 102, limit=50, top=2)
        arm(r, 3, 1, 103, limit=50, ignore_eos=True, top=0)
        arm(r, 4, 0, 104, limit=50, top=5)
        r.final(-1, Target(1, 900), FinishReason.ERROR)  # refused at admission
    rows = [(s, 3) for s in range(5)]
    twins.step(rows, [11, 12, 13, 14, 15], top=5)
    twins.assert_equal()
    # slot 1 hits a stop id, slot 3 an EOS it ignores, slot 4 an EOS that stops it.
    twins.step([(s, 4) for s in range(5)], [21, 9, 23, EOS[0], EOS[1]], top=5)
    twins.assert_equal()
    for r in twins.both():
        r.final(2, Target(0, 102), FinishReason.CANCELLED)  # live: published
        r.final(1, Target(1, 101), FinishReason.CANCELLED)  # stopped already: nothing
    # slot 0 reaches its limit; rows of closed slots (1, 4, 2) write nothing.
    twins.step([(0, 5), (1, 5), (2, 5), (3, 5), (4, 5)], [31, 32, 33, 34, 35], top=5)
    twins.assert_equal()
    tallies = twins.gpu.backend.tallies()
    assert [t.cancelled for t in tallies] == [1, 0]
    assert tallies[0].completed == 2 and tallies[1].completed == 2  # length, stop; stop, error
    # Channel 1 reattaches at epoch 2: positions restart, its slot 3 is closed.
    twins.gpu.drain()
    for r in twins.both():
        r.reset(1, 2)
        arm(r, 5, 1, 7, limit=100)
    twins.step([(3, 6), (5, 3)], [41, 42])
    twins.assert_equal()
    assert twins.gpu.backend.tallies()[1].reserved == 1 and twins.gpu.backend.tallies()[1].epoch == 2
    print("record writer kernel = its Python twin, byte for byte, over 4 launches: "
          f"{sum(t.published for t in twins.gpu.backend.tallies())} records")


def test_a_record_with_no_free_slot_is_refused_and_reported(library: Path) -> None:
    layout = Geometry(channels=1, req_slots=16, arena_bytes=4096, resp_slots=4,
                      max_sequences=2).plan(instance=4)
    twins = Twins(library, layout)
    for r in twins.both():
        r.reset(0, 1)
        for s in range(3):
            arm(r, s, 0, s, limit=100)
    twins.step([(0, 2), (1, 2), (2, 2)], [1, 2, 3])
    twins.consume(0, 0)
    twins.gpu.launch(np.array([(0, 3), (1, 3)], np.int64),
                     Drawn(torch.tensor([4, 5], device="cuda"), None, None, None))
    with pytest.raises(RuntimeError, match="no free response slot"):
        twins.gpu.drain()
    assert twins.gpu.backend.tallies()[0].reserved == 4  # the ring's 4 slots, no more
