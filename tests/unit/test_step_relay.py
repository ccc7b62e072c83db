"""Tensor parallelism's step relay (``gpu/step_relay.h``), built for the host with the
leader and every follower on a thread of its own: each follower takes every step the
leader sent, in order, its graph and its bytes exactly, whatever the ranks' drift; a
follower whose kernel stops taking steps faults the leader within its patience, which
names it, rather than hanging it; and a follower waiting for a step that never comes
ends on its stop word."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from dpu_frontend.gpu.step_relay import STEP, STOP, HostRelay, Step


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("relay")


def random_steps(rng: random.Random, count: int, capacity: int) -> list[tuple[int, bytes]]:
    """Sizes from empty to full, odd ones (a tail past the 16-byte words) among them."""
    sizes = [0, capacity, 1, 15, 17, capacity - 1]
    return [(rng.randrange(0, 40),
             rng.randbytes(sizes[k] if k < len(sizes) else rng.randrange(0, capacity + 1)))
            for k in range(count)]


def sent(steps: list[tuple[int, bytes]]) -> list[Step]:
    return [Step(s + 1, STOP if s == len(steps) - 1 else STEP, graph, payload)
            for s, (graph, payload) in enumerate(steps)]


@pytest.mark.parametrize("followers", [1, 2, 3, 7])
def test_every_follower_takes_every_step_in_order(build_dir: Path, followers: int) -> None:
    """300 steps through boxes of 4 KiB, the ranks drifting apart (a leader ahead writes
    step s + 1 into the other box while a follower still copies step s)."""
    rng = random.Random(followers)
    relay = HostRelay.build(build_dir, followers, 4096)
    steps = random_steps(rng, 300, 4096)
    got = relay.run(steps, seed=followers + 1)
    assert got.fault is None
    assert got.taken == [sent(steps)] * followers


def test_a_follower_that_takes_no_steps_faults_the_leader_and_names_it(build_dir: Path) -> None:
    """Follower 2 of 3 stops after step 10: the leader, finding its box still full for
    step 13 (two boxes: steps 11 and 12 fit), faults within a 1 s patience and sends
    step 13 to no one (every box is waited for before any is written); its host stops
    the followers. What each follower took is a prefix of what was sent, follower 2's
    exactly its 10 steps, the others' at most 12."""
    rng = random.Random(5)
    relay = HostRelay.build(build_dir, 3, 256)
    steps = random_steps(rng, 100, 256)
    got = relay.run(steps, patience_s=1.0, stalled=2, stall_after=10, seed=9)
    assert got.fault == ("the step relay's leader found follower 2's box still full past its "
                         "patience: that rank's kernel takes no steps")
    assert got.taken[1] == sent(steps)[:10]
    for taken in (got.taken[0], got.taken[2]):
        assert taken == sent(steps)[:len(taken)] and 10 <= len(taken) <= 12


def test_a_follower_waiting_for_a_step_that_never_comes_ends_on_its_stop(
        build_dir: Path) -> None:
    got = HostRelay.build(build_dir, 2, 64).run([], patience_s=0.1)
    assert got.taken == [[], []] and got.fault is None


def test_what_the_relay_does_not_take_is_refused(build_dir: Path) -> None:
    with pytest.raises(ValueError, match="1 to 7"):
        HostRelay.build(build_dir, 8, 64)
    with pytest.raises(ValueError, match="a multiple of 16"):
        HostRelay.build(build_dir, 1, 40)
    with pytest.raises(ValueError, match="past the boxes' 64 bytes"):
        HostRelay.build(build_dir, 1, 64).run([(0, b"x" * 65)])
