"""Paged KV bookkeeping and continuous batching, without a device."""

from __future__ import annotations

import random

import pytest

from dpu_frontend.model.blocks import BlockPool, BlockTable
from dpu_frontend.model.scheduler import Batch, Scheduler, Sequence, Status
from dpu_frontend.ring.records import SamplingParams


def test_pool_hands_out_whole_blocks_and_takes_them_back() -> None:
    pool = BlockPool(4, 16)
    assert pool.blocks_for(16) == 1 and pool.blocks_for(17) == 2
    a = pool.allocate(3)
    assert a is not None and pool.free == 1
    assert pool.allocate(2) is None and pool.free == 1
    pool.release(a)
    assert pool.free == 4
    with pytest.raises(ValueError, match="released twice"):
        pool.release(a[:1])


def test_block_table_slots() -> None:
    pool = BlockPool(8, 4)
    pool.allocate(2)  # blocks 0, 1 elsewhere
    table = BlockTable(pool)
    assert table.reserve(6) and table.blocks == [2, 3] and table.capacity == 8
    assert table.slot(0) == 8 and table.slot(5) == 13
    assert not BlockTable(pool).reserve(100) and pool.free == 4  # nothing taken on failure


def sched(blocks: int = 64, page: int = 16, **kw: int) -> Scheduler:
    kw = {"max_seqs": 8, "max_batched_tokens": 64, "max_model_len": 256} | kw
    return Scheduler(BlockPool(blocks, page), **kw)


def params(max_tokens: int = 4) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


def run(s: Scheduler, batch: Batch) -> None:
    """What the engine does after a step: commit, then retire what reached its limit."""
    s.commit(batch)
    for w in batch.works:
        if w.sample and w.seq.status is Status.RUNNING and w.seq.total >= w.seq.limit:
            s.finish(w.seq)


def test_long_prompt_is_prefilled_in_chunks_and_samples_once() -> None:
    s = sched()
    seq = s.add(1, 150, params(2), seed=0)
    b1 = s.schedule()
    assert [(w.start, w.count, w.sample) for w in b1.works] == [(0, 64, False)]
    assert b1.admitted == [seq] and seq.slot == 0
    run(s, b1)
    b2 = s.schedule()
    run(s, b2)
    b3 = s.schedule()
    assert [(w.start, w.count, w.sample) for w in b3.works] == [(128, 22, True)]
    run(s, b3)
    assert seq.generated == 1 and seq.computed == 150
    b4 = s.schedule()
    assert [(w.start, w.count, w.sample) for w in b4.works] == [(150, 1, True)]
    run(s, b4)
    assert seq.status is Status.FINISHED and s.idle and s.pool.free == 64


def test_decodes_go_first_then_chunks_then_admission() -> None:
    s = sched(max_batched_tokens=40)
    a = s.add(1, 10, params(8), seed=0)
    run(s, s.schedule())
    b = s.add(2, 100, params(8), seed=0)
    batch = s.schedule()
    assert [(w.seq, w.count) for w in batch.works] == [(a, 1), (b, 39)]


def test_admission_waits_for_blocks_and_slots() -> None:
    s = sched(blocks=8, page=16, max_seqs=2, max_model_len=128)  # 128 tokens of cache
    a = s.add(1, 100, params(4), seed=0)
    b = s.add(2, 60, params(4), seed=0)  # 4 blocks: only 1 left after a's 7
    batch = s.schedule()
    assert [w.seq for w in batch.works] == [a] and b.status is Status.WAITING
    s.finish(a)
    batch = s.schedule()
    assert [w.seq for w in batch.works] == [b]
    c = s.add(3, 5, params(), seed=0)
    d = s.add(4, 5, params(), seed=0)
    batch = s.schedule()
    assert c.status is Status.RUNNING and d.status is Status.WAITING  # two slots only


def test_a_decode_without_a_block_preempts_the_youngest() -> None:
    s = sched(blocks=4, page=4, max_model_len=16, max_batched_tokens=64)
    old = s.add(1, 8, params(8), seed=0)
    young = s.add(2, 7, params(8), seed=0)
    run(s, s.schedule())  # both prefilled: 2 blocks each, the pool is empty
    assert s.pool.free == 0 and old.total == 9 and young.total == 8
    batch = s.schedule()  # old needs a third block for position 8: young is preempted
    assert batch.preempted == [young] and young.status is Status.WAITING and young.computed == 0
    assert [(w.seq, w.start) for w in batch.works] == [(old, 8)]
    assert young.slot >= 0 and s.preemptions == 1  # keeps its slot: its tokens are there
    s.finish(old)
    batch = s.schedule()  # recomputed: prompt and the token it had drawn
    assert [(w.seq, w.start, w.count, w.sample) for w in batch.works] == [(young, 0, 8, True)]
    assert batch.admitted == []


def test_cancel_while_waiting_or_running_frees_everything() -> None:
    s = sched()
    seqs = [s.add(i, 30, params(), seed=0) for i in range(5)]
    s.schedule()
    for seq in seqs:
        s.finish(seq)
        s.finish(seq)  # twice is harmless
    assert s.idle and s.pool.free == 64
    assert sorted(s._free_slots) == list(range(8))


def test_refusals() -> None:
    with pytest.raises(ValueError, match="does not fit a KV cache"):
        sched(blocks=2, page=16, max_model_len=64)
    s = sched()
    with pytest.raises(ValueError, match="does not leave room"):
        s.add(1, 256, params(), seed=0)
    assert s.add(2, 250, params(100), seed=0).limit == 256


def test_random_traffic_keeps_the_invariants() -> None:
    rng = random.Random(5)
    s = sched(blocks=24, page=8, max_seqs=6, max_batched_tokens=48, max_model_len=128)
    live: dict[int, Sequence] = {}
    for step in range(3000):
        if rng.random() < 0.3 and len(live) < 12:
            seq = s.add(step, rng.randrange(1, 100), params(rng.randrange(1, 28)), seed=0)
            live[step] = seq
        batch = s.schedule()
        held = [b for seq in s.running for b in seq.table.blocks]
        assert len(held) == len(set(held)) == s.pool.num_blocks - s.pool.free
        assert all(seq.table.blocks == [] for seq in s.waiting if seq.status is Status.WAITING)
        for w in batch.works:
            assert w.start == w.seq.computed and w.start + w.count <= w.seq.table.capacity
        run(s, batch)
        if live and rng.random() < 0.05:
            s.finish(live.pop(rng.choice(list(live))))
        live = {k: v for k, v in live.items() if v.status is not Status.FINISHED}
    while not s.idle:
        run(s, s.schedule())
    assert s.pool.free == s.pool.num_blocks
