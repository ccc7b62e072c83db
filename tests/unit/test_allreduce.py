"""Tensor parallelism's all-reduce over peer memory (``gpu/allreduce.h``), built for the
host with every block of every rank on a thread of its own: its bits against the
rank-order sum that ``model.layers.collective.sum_in_rank_order`` defines (rank 0's
value, plus rank 1's, ... in float32, rounded once), on every rank, one-shot and
two-shot, for message sizes that do and do not divide into the ranks' slices and the
blocks, over calls that reuse the flags."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dpu_frontend.gpu.allreduce import FAULT, HostAllReduce, Stalled, describe_fault


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("allreduce")


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 to bfloat16's bits, to nearest, ties to even (torch's rounding)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def values(rng: np.random.Generator, n: int, dtype: str) -> np.ndarray:
    """Magnitudes over many binades, zeros of both signs, values that cancel: the
    dtype's bits (bfloat16 as uint16)."""
    x = rng.standard_normal(n) * np.float32(2.0) ** rng.integers(-20, 20, n)
    x[rng.random(n) < 0.05] = 0.0
    x[rng.random(n) < 0.05] = -0.0
    x = x.astype(np.float32)
    return to_bf16(x) if dtype == "bfloat16" else x


def rank_order_sum(inputs: list[np.ndarray], dtype: str) -> bytes:
    parts = [from_bf16(x) if dtype == "bfloat16" else x for x in inputs]
    total = parts[0].astype(np.float32)
    for part in parts[1:]:
        total = (total + part).astype(np.float32)
    return (to_bf16(total) if dtype == "bfloat16" else total).tobytes()


CASES = [(ranks, n, blocks) for ranks in (1, 2, 3, 4, 8) for n, blocks in
         ((1, 1), (7, 3), (1000, 1), (1000, 8), (4099, 5))]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("ranks", "n", "blocks"), CASES)
def test_every_rank_gets_the_rank_order_sum_one_shot_and_two_shot(
        build_dir: Path, dtype: str, ranks: int, n: int, blocks: int) -> None:
    rng = np.random.default_rng(ranks * 1000 + n + blocks)
    ar = HostAllReduce.build(build_dir, ranks, n, dtype, blocks)
    for call in range(4):  # the flags of one call are the next one's: epochs tell them apart
        inputs = [values(rng, n, dtype) for _ in range(ranks)]
        want = rank_order_sum(inputs, dtype)
        got = ar([x.tobytes() for x in inputs], two_shot=call % 2 == 1)
        assert got == [want] * ranks, (call, dtype, ranks, n, blocks)


@pytest.mark.parametrize(("ranks", "blocks"), [(2, 1), (4, 3), (8, 2)])
def test_ranks_that_drift_apart_never_overwrite_what_another_still_reads(
        build_dir: Path, ranks: int, blocks: int) -> None:
    """Each rank on a stream of its own, pausing at random, 100 calls: a fast rank
    starts its next call (its copy into its buffer, its READY) while a slow one still
    sums or copies the last; DONE keeps it from overwriting what that one reads, and
    the epochs keep the calls' flags apart. Every call's result on every rank is its
    own inputs' sum. (Without DONE's wait the calls mix, or the ranks wait forever.)"""
    rng = np.random.default_rng(ranks * 10 + blocks)
    n, dtype = 257, "float32"
    calls = [[values(rng, n, dtype) for _ in range(ranks)] for _ in range(100)]
    ar = HostAllReduce.build(build_dir, ranks, n, dtype, blocks)
    got = ar.stream([[x.tobytes() for x in call] for call in calls], seed=ranks + blocks)
    for k, call in enumerate(calls):
        assert got[k] == [rank_order_sum(call, dtype)] * ranks, k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_same_values_in_another_message_give_the_same_bits(build_dir: Path, dtype: str) -> None:
    """The same ranks' values as the first 37 elements of a message of 4,099 cut into 5
    blocks two-shot, and alone in one block one-shot: the same bits (what a row's
    output in a batch of another size must keep)."""
    rng = np.random.default_rng(7)
    long = [values(rng, 4099, dtype) for _ in range(4)]
    whole = HostAllReduce.build(build_dir, 4, 4099, dtype, 5)([x.tobytes() for x in long],
                                                              two_shot=True)[0]
    head = HostAllReduce.build(build_dir, 4, 37, dtype, 1)([x[:37].tobytes() for x in long],
                                                           two_shot=False)[0]
    width = 2 if dtype == "bfloat16" else 4
    assert head == whole[:37 * width]


def test_bfloat16_rounds_to_nearest_even_as_torch_does(build_dir: Path) -> None:
    """Sums that land halfway between two bfloat16 values, and just off it: ties go to
    the even neighbour, the rest to the nearer."""
    one = np.float32(1.0)
    step = np.float32(2.0 ** -8)  # bfloat16's spacing at 1.0 is 2**-7: half of it is a tie
    a = to_bf16(np.array([one, one + 2 * step, one, one], dtype=np.float32))
    b = to_bf16(np.array([step, step, step * 1.5, step / 2], dtype=np.float32))
    got = HostAllReduce.build(build_dir, 2, 4, "bfloat16", 1)([a.tobytes(), b.tobytes()],
                                                              two_shot=False)[0]
    sums = from_bf16(np.frombuffer(got, dtype=np.uint16))
    assert list(sums) == [1.0, 1.0 + 4 * 2.0 ** -8, 1.0 + 2.0 ** -7, 1.0]
    assert got == rank_order_sum([a, b], "bfloat16")


def test_a_shape_it_does_not_take_is_refused(build_dir: Path) -> None:
    with pytest.raises(ValueError, match="1 to 8"):
        HostAllReduce.build(build_dir, 9, 4, "float32", 1)
    ar = HostAllReduce.build(build_dir, 2, 4, "float32", 1)
    with pytest.raises(ValueError, match="2 inputs of 16 bytes"):
        ar([b"\0" * 16], two_shot=False)


@pytest.mark.parametrize("two_shot", [False, True], ids=["one-shot", "two-shot"])
def test_a_stalled_rank_ends_the_others_calls_with_a_fault_that_names_it(
        build_dir: Path, two_shot: bool) -> None:
    """Rank 1 of 3 runs no block (its kernel stopped): the others wait for its READY no
    longer than their patience (1 s), raise their fault words naming it and the phase, and
    their calls end (``Stalled``), rather than hang. The fault stays: the next call,
    with every rank there, still fails at once on those ranks, and rank 1 has none."""
    rng = np.random.default_rng(11)
    ar = HostAllReduce.build(build_dir, 3, 64, "float32", 2, patience_s=1.0)
    inputs = [values(rng, 64, "float32").tobytes() for _ in range(3)]
    with pytest.raises(Stalled) as stalled:
        ar(inputs, two_shot=two_shot, absent=1)
    want = [f"rank {r}'s all-reduce waited past its patience for rank 1 at READY: that "
            "rank's kernel stopped or stalls" for r in (0, 2)]
    assert stalled.value.faults == [want[0], None, want[1]]
    assert ar.faults() == [want[0], None, want[1]]
    with pytest.raises(Stalled) as again:
        ar(inputs, two_shot=two_shot)
    assert again.value.faults == [want[0], None, want[1]]


def test_every_rank_there_raises_no_fault_with_a_patience_shorter_than_the_run(
        build_dir: Path) -> None:
    """A patience of 1 s over 100 drifting calls (pauses of up to 200 us; the arm64
    lane runs them emulated): no wait is taken for a stall, every sum is right."""
    rng = np.random.default_rng(12)
    ar = HostAllReduce.build(build_dir, 4, 100, "bfloat16", 3, patience_s=1.0)
    calls = [[values(rng, 100, "bfloat16") for _ in range(4)] for _ in range(100)]
    got = ar.stream([[x.tobytes() for x in call] for call in calls], seed=5)
    assert all(got[k] == [rank_order_sum(call, "bfloat16")] * 4 for k, call in enumerate(calls))
    assert ar.faults() == [None] * 4


def test_a_fault_word_reads_as_what_raised_it() -> None:
    assert describe_fault(0, 0) is None
    assert describe_fault(2, FAULT | 2 << 8 | 3) == (
        "rank 2's all-reduce waited past its patience for rank 3 at DONE: that rank's kernel "
        "stopped or stalls")
    assert describe_fault(1, 7) == "rank 1's all-reduce fault word holds 0x7, no fault it raises"
