"""A step's metadata, vectorized, against the per-work loop it replaced."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dpu_frontend.model.blocks import BlockPool, BlockTable
from dpu_frontend.model.metadata import SamplingRows, SlotParams, StepInputs, step_inputs
from dpu_frontend.model.scheduler import Batch, Sequence, Status, Work
from dpu_frontend.ring.records import SamplingParams

PAGE, PER_TILE = 16, 32


def loop_reference(batch: Batch) -> dict[str, np.ndarray]:
    out: dict[str, list[int]] = {k: [] for k in (
        "slots", "positions", "cache_slots", "tile_seq", "tile_row", "q_start", "q_len",
        "ctx_start", "sample_rows")}
    row = 0
    for i, w in enumerate(batch.works):
        blocks = w.seq.table.blocks
        for pos in range(w.start, w.start + w.count):
            out["positions"].append(pos)
            out["cache_slots"].append(blocks[pos // PAGE] * PAGE + pos % PAGE)
            out["slots"].append(w.seq.slot)
        for first in range(0, w.count, PER_TILE):
            out["tile_seq"].append(i)
            out["tile_row"].append(first)
        out["q_start"].append(row)
        out["q_len"].append(w.count)
        out["ctx_start"].append(w.start)
        row += w.count
        if w.sample:
            out["sample_rows"].append(row - 1)
    widest = max(len(w.seq.table.blocks) for w in batch.works)
    tables = np.zeros((len(batch.works), widest), dtype=np.int32)
    for i, w in enumerate(batch.works):
        tables[i, :len(w.seq.table.blocks)] = w.seq.table.blocks
    return {k: np.asarray(v) for k, v in out.items()} | {"tables": tables}


def batch_of(rng: random.Random, decode_only: bool) -> Batch:
    pool = BlockPool(4096, PAGE)
    pool.allocate(rng.randrange(50))  # tables start anywhere
    works = []
    for i in range(rng.randrange(1, 40)):
        start = rng.randrange(0, 300)
        count = 1 if decode_only or rng.random() < 0.5 else rng.randrange(1, 200)
        seq = Sequence(i, start + count, SamplingParams(max_tokens=8), seed=0, limit=1 << 20,
                       table=BlockTable(pool), slot=rng.randrange(256), computed=start,
                       status=Status.RUNNING)
        assert seq.table.reserve(start + count)
        works.append(Work(seq, start, count, decode_only or rng.random() < 0.7))
    return Batch(works=works)


@pytest.mark.parametrize("decode_only", [True, False])
def test_the_vectorized_metadata_equals_the_loop(decode_only: bool) -> None:
    rng = random.Random(7)
    for _ in range(50):
        batch = batch_of(rng, decode_only)
        got = step_inputs(batch, PAGE, PER_TILE)
        want = loop_reference(batch)
        for name, expected in want.items():
            value = getattr(got, name)
            assert value.tolist() == expected.tolist(), name
        assert got.tile_seq.dtype == got.q_len.dtype == got.tables.dtype == np.int32
        assert got.positions.dtype == got.cache_slots.dtype == got.slots.dtype == np.int64
        assert isinstance(got, StepInputs) and got.decode == (
            decode_only and all(w.sample for w in batch.works))


def test_slot_params_gather_what_the_rows_say() -> None:
    """A step's sampling rows gathered from the slots equal those built row by row, and
    the stage flags follow the rows actually in the step."""
    vocab = 1000
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    fancy = SamplingParams(max_tokens=8, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05,
                           presence_penalty=0.5, repetition_penalty=1.1)
    huge_k = SamplingParams(max_tokens=8, temperature=1.0, top_k=5000)  # past the vocabulary: off
    table = SlotParams(8, vocab)
    seeds = {1: 7, 4: (1 << 64) - 1, 6: 1 << 63}
    for slot, params in ((1, greedy), (4, fancy), (6, huge_k)):
        table.set(slot, params, seeds[slot])
    rows = table.rows(np.array([4, 1, 6]), np.array([3, 0, 9]))
    want = SamplingRows.from_params([(fancy, seeds[4], 3), (greedy, seeds[1], 0),
                                     (huge_k, seeds[6], 9)], vocab)
    assert np.array_equal(rows.floats, want.floats) and np.array_equal(rows.ints, want.ints)
    assert rows.ints[1].tolist() == [-1, 7, -(1 << 63)]  # a u64 seed's bits as an int64
    assert rows.ints[0].tolist() == [40, 0, 0] and rows.top_k_max == 40
    assert (rows.any_top_k, rows.any_top_p, rows.any_min_p, rows.any_penalty,
            rows.all_greedy) == (True, True, True, True, False)
    alone = table.rows(np.array([1]), np.array([5]))
    assert (alone.any_top_k, alone.any_top_p, alone.any_penalty, alone.all_greedy) == (
        False, False, False, True)
    assert SamplingRows.from_params([], vocab).floats.shape == (6, 0)


def test_a_slot_never_set_draws_without_penalties_or_cuts() -> None:
    rows = SlotParams(4, 1000).rows(np.array([2, 3]), np.array([0, 0]))
    assert not (rows.any_penalty or rows.any_top_k or rows.any_top_p or rows.any_min_p)


@pytest.mark.parametrize("seed", range(20))
def test_the_chosen_variant_runs_every_stage_its_rows_need(seed: int) -> None:
    """The GPU scheduler's sampler graph for a batch (``SamplingRows.variant``) runs at
    least the stages the host path would run for it (``stages_of``), and no fuller
    variant is chosen where a cheaper one covers the batch."""
    rng = random.Random(seed)
    rows = [(SamplingParams(max_tokens=1, temperature=rng.choice((0.0, 0.7)),
                            top_p=rng.choice((1.0, 1.0, 0.9)), top_k=rng.choice((0, 0, 5)),
                            min_p=rng.choice((0.0, 0.0, 0.1)),
                            presence_penalty=rng.choice((0.0, 0.0, 0.5)),
                            repetition_penalty=rng.choice((1.0, 1.0, 1.2))), seed, 0)
            for _ in range(rng.randint(1, 6))]
    facts = SamplingRows.from_params(rows, 1000)
    for logprobs in (False, True):
        variant = facts.variant(logprobs)
        runs = SamplingRows.stages_of(variant, 1000)
        needs = (facts.any_top_k, facts.any_top_p, facts.any_min_p, facts.any_penalty)
        assert all(r or not n for r, n in zip(
            (runs.any_top_k, runs.any_top_p, runs.any_min_p, runs.any_penalty), needs, strict=True))
        assert runs.all_greedy <= facts.all_greedy
        assert (variant == "logprobs") == logprobs
        if not logprobs and not any(needs):
            assert variant == ("greedy" if facts.all_greedy else "plain")
