"""The GPU scheduler's C core (``sched_core.h``) against the Python scheduler.

The core, built for the host, and ``dpu_frontend.model.scheduler`` are driven
by the same seeded workloads: arrivals, steps under ring credits, stops,
cancels, and KV caches small enough that sequences are preempted and
admission waits. Every step must give the same batch (works, admissions,
preemptions, held channels), the same graph, the same bytes in that
graph's static inputs as ``metadata.step_inputs`` and ``GraphShape.fill``,
and at its commit the KV positions read that the host engine counts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpu_frontend.model.blocks import BlockPool
from dpu_frontend.model.device.sched_core import (
    BAD_ENTRY,
    BAD_PROMPT,
    FULL,
    NO_GRAPH,
    SEQ_FREE,
    SEQ_RUNNING,
    SEQ_WAITING,
    HostSchedCore,
    SchedConfig,
)
from dpu_frontend.model.metadata import graph_for, graph_shapes, step_inputs
from dpu_frontend.model.scheduler import Scheduler, Sequence, Status
from dpu_frontend.ring.records import SamplingParams

CHANNELS = 3


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sched-core")


class Twin:
    """The Python scheduler and the C core, given the same operations."""

    def __init__(self, build_dir: Path, *, max_seqs: int, max_batched_tokens: int,
                 max_model_len: int, block_size: int, num_blocks: int, per_tile: int,
                 capacity: int = 256, serial: bool = False) -> None:
        #: The core schedules by its one-thread loop alone, not as the kernel does.
        self.serial = serial
        self.py = Scheduler(BlockPool(num_blocks, block_size), max_seqs=max_seqs,
                            max_batched_tokens=max_batched_tokens, max_model_len=max_model_len)
        self.page, self.per_tile = block_size, per_tile
        self.scratch = num_blocks * block_size
        config = SchedConfig(max_seqs=max_seqs, max_batched_tokens=max_batched_tokens,
                             max_model_len=max_model_len, block_size=block_size,
                             num_blocks=num_blocks, capacity=capacity, per_tile=per_tile,
                             scratch_slot=self.scratch)
        self.c = HostSchedCore.build(build_dir, config)
        # Token buckets as the runner's are to its budget: the largest holds any step.
        buckets = tuple(sorted({max(1, max_batched_tokens // 4), max_batched_tokens // 2 or 1,
                                max_batched_tokens}))
        self.shapes = graph_shapes(max_seqs, self.c.max_blocks, buckets)
        for shape in self.shapes:
            self.c.add_graph(shape.tokens, shape.seqs, shape.tiles, shape.samples, shape.nbytes)
        self.entry: dict[int, int] = {}  # seq_id -> the core's entry
        self.seqs: dict[int, Sequence] = {}
        self.channel: dict[int, int] = {}
        self.next_id = 0
        self.steps = self.preemptions = self.held_steps = 0

    def close(self) -> None:
        self.c.close()

    def add(self, prompt_len: int, max_tokens: int, channel: int) -> None:
        seq_id = self.next_id
        self.next_id += 1
        params = SamplingParams(max_tokens=max_tokens)
        seq = self.py.add(seq_id, prompt_len, params, seed=0)
        entry = self.c.add(seq_id, prompt_len, max_tokens, channel)
        assert entry >= 0
        self.entry[seq_id], self.seqs[seq_id], self.channel[seq_id] = entry, seq, channel

    def finish(self, seq_id: int) -> None:
        self.py.finish(self.seqs.pop(seq_id))
        assert self.c.finish(self.entry.pop(seq_id)) == 0
        del self.channel[seq_id]

    def step(self, credits: list[int], rng: random.Random) -> None:
        """One step under ``credits`` (records each channel's ring takes), then what
        the engine does: commit, retire what reached its limit, and stop some."""
        left = list(credits)
        held: set[int] = set()

        def room(seq: Sequence) -> bool:
            c = self.channel[seq.seq_id]
            if c < 0:
                return True
            if left[c] <= 0:
                held.add(c)
                return False
            left[c] -= 1
            return True

        for c, n in enumerate(credits):
            self.c.set_credit(c, n)
        batch = self.py.schedule(room)
        got = self.c.schedule(serial=self.serial)
        ids = {e: s for s, e in self.entry.items()}
        assert [(ids[int(e)], int(s), int(n), bool(k)) for e, s, n, k in got.works] == [
            (w.seq.seq_id, w.start, w.count, w.sample) for w in batch.works]
        assert [ids[e] for e in got.admitted] == [s.seq_id for s in batch.admitted]
        assert [ids[e] for e in got.preempted] == [s.seq_id for s in batch.preempted]
        assert got.held == sum(1 << c for c in held)
        assert got.free_blocks == self.py.pool.free
        self.preemptions += len(batch.preempted)
        self.held_steps += bool(held)
        if batch.works:
            self.steps += 1
            self.check_inputs(batch)
        self.py.commit(batch)
        # The KV positions the step read, counted as the host engine counts them
        # (EngineStats.context_tokens): the GPU scheduler's context_tokens.
        assert self.c.commit() == sum(w.start + w.count for w in batch.works)
        for w in batch.works:
            seq = w.seq
            if w.sample and seq.status is Status.RUNNING and (
                    seq.total >= seq.limit or rng.random() < 0.05):
                self.finish(seq.seq_id)
        self.check_states()

    def check_inputs(self, batch: object) -> None:
        step = step_inputs(batch, self.page, self.per_tile)  # type: ignore[arg-type]
        expected = graph_for(self.shapes, step)
        g = self.c.graph_for()
        assert g == (NO_GRAPH if expected is None else expected)
        if expected is None:
            return
        shape = self.shapes[g]
        want = shape.views(np.zeros(shape.nbytes, np.uint8))
        shape.fill(want, step, self.scratch)
        got = shape.views(self.c.fill(g))
        for name, array in want.items():
            np.testing.assert_array_equal(got[name], array, err_msg=name)

    def check_states(self) -> None:
        for seq_id, seq in self.seqs.items():
            state, blocks = self.c.seq(self.entry[seq_id])
            assert (state.slot, state.computed, state.generated, state.limit) == (
                seq.slot, seq.computed, seq.generated, seq.limit)
            assert state.status == (SEQ_RUNNING if seq.status is Status.RUNNING else SEQ_WAITING)
            assert blocks == seq.table.blocks


def workload(twin: Twin, rng: random.Random, ops: int) -> Iterator[None]:
    longest = twin.py.max_model_len - 1
    for _ in range(ops):
        r = rng.random()
        if r < 0.3:
            prompt = rng.choice([1, 2, rng.randint(1, longest), rng.randint(1, 3 * twin.page)])
            twin.add(min(prompt, longest), rng.choice([1, 2, rng.randint(1, 40)]),
                     rng.randrange(-1, CHANNELS))
        elif r < 0.35 and twin.seqs:
            twin.finish(rng.choice(list(twin.seqs)))  # a cancel: waiting or running
        else:
            credits = [rng.choice([0, 1, 2, 1 << 40]) for _ in range(CHANNELS)]
            twin.step(credits, rng)
        yield


@pytest.mark.parametrize("serial", [False, True], ids=["as-the-kernel", "serial-loop"])
@pytest.mark.parametrize("seed", range(24))
def test_the_core_makes_the_python_schedulers_decisions(build_dir: Path, seed: int,
                                                        serial: bool) -> None:
    """As the kernel schedules (the decodes spread over threads where a step allows, in
    loops here) and by the one-thread loop alone."""
    rng = random.Random(seed)
    page = rng.choice([1, 2, 4, 16])
    max_model_len = rng.choice([8, 24, 64, 130])
    blocks = -(-max_model_len // page)
    twin = Twin(build_dir, max_seqs=rng.choice([1, 2, 3, 5, 8]),
                max_batched_tokens=rng.choice([1, 3, 8, 32, 64]), max_model_len=max_model_len,
                block_size=page, num_blocks=rng.choice([blocks, blocks + 1, 2 * blocks, 8 * blocks]),
                per_tile=rng.choice([1, 2, 3, 8]), serial=serial)
    try:
        for _ in workload(twin, rng, 600):
            pass
        while twin.seqs:  # drain: everything finishes
            twin.step([1 << 40] * CHANNELS, rng)
        assert twin.c.schedule().works.shape[0] == 0
    finally:
        twin.close()


def test_the_workloads_reach_preemption_holds_and_every_graph(build_dir: Path) -> None:
    """The seeded workloads above are worth their time: they preempt, hold
    sequences for ring room, and run decode and mixed graphs."""
    twin = Twin(build_dir, max_seqs=4, max_batched_tokens=16, max_model_len=40, block_size=4,
                num_blocks=12, per_tile=2)
    rng = random.Random(7)
    graphs: set[int] = set()
    try:
        for _ in workload(twin, rng, 800):
            if twin.py.running:
                graphs.add(twin.c.graph_for())
        assert twin.preemptions > 0 and twin.held_steps > 0 and twin.steps > 100
        assert len(graphs - {NO_GRAPH}) >= 4
        # The decodes ran spread in some steps, and by the serial loop in others (a
        # preemption, a ring without room for every decode).
        assert 0 < twin.c.spread_steps < twin.steps
    finally:
        twin.close()


@pytest.mark.parametrize("seed", range(3))
def test_a_full_batch_of_hundreds_is_scheduled_as_the_python_scheduler_does(
        build_dir: Path, seed: int) -> None:
    """Batches of hundreds of sequences, as the GPU runs them: the spread decodes' sums
    over many sequences and blocks, a pool tight enough to preempt at times."""
    rng = random.Random(100 + seed)
    twin = Twin(build_dir, max_seqs=256, max_batched_tokens=512, max_model_len=96,
                block_size=8, num_blocks=rng.choice([700, 1100, 2600]), per_tile=8,
                capacity=512)
    peak = 0
    try:
        for step in range(400):
            # Arrivals faster than the batch drains, then slower.
            for _ in range(rng.randint(0, 40 if step < 100 else 8)):
                if len(twin.seqs) < 500:
                    twin.add(rng.randint(1, 40), rng.randint(1, 50), rng.randrange(-1, CHANNELS))
            credits = [rng.choice([16, 1 << 40, 1 << 40]) for _ in range(CHANNELS)]
            twin.step(credits, rng)
            peak = max(peak, len(twin.py.running))
        assert peak >= 150 and 0 < twin.c.spread_steps < twin.steps
    finally:
        twin.close()


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_hypothesis_workloads(build_dir: Path, data: st.DataObject) -> None:
    twin = Twin(build_dir, max_seqs=data.draw(st.integers(1, 6)),
                max_batched_tokens=data.draw(st.integers(1, 40)),
                max_model_len=data.draw(st.integers(4, 70)),
                block_size=data.draw(st.sampled_from([1, 2, 4, 8])),
                num_blocks=data.draw(st.integers(70, 140)),
                per_tile=data.draw(st.integers(1, 4)))
    try:
        for _ in workload(twin, random.Random(data.draw(st.integers(0, 2**32))), 200):
            pass
    finally:
        twin.close()


def test_the_core_refuses_what_the_python_scheduler_refuses(build_dir: Path) -> None:
    twin = Twin(build_dir, max_seqs=2, max_batched_tokens=8, max_model_len=16, block_size=4,
                num_blocks=4, per_tile=1, capacity=2)
    try:
        c = twin.c
        assert c.add(0, 0, 4) == BAD_PROMPT and c.add(0, 16, 4) == BAD_PROMPT
        assert c.add(0, 15, 4) >= 0 and c.add(1, 1, 4) >= 0
        assert c.add(2, 1, 4) == FULL  # every entry in use
        assert c.finish(1) == 0 and c.finish(1) == BAD_ENTRY and c.finish(99) == BAD_ENTRY
        state, _ = c.seq(1)
        assert state.status == SEQ_FREE
        assert c.add(3, 1, 4) == 1  # the freed entry again
    finally:
        twin.close()
