"""What a constrained request's automaton costs the host-driven GPU side at intake.

The reference peer and the model peer's host loop take each request record off the
ring (``GpuChannel.poll_requests``) and hand a constrained one its checked automaton
(``ReferenceKernel``). The first request of a constraint copies the automaton out of
the arena and checks it (``decode_automaton``); a later one of the same identity (the
header's key and the request's size: one key, one automaton) gets the checked copy,
its bytes unread. Before that, every request copied the whole automaton out and hashed
it to find its copy: that path is timed here too, in the same run.

Beside them, the bare limit of the same run: one copy of the automaton's bytes out of
the region (what reading it takes at the least).

    python -m benchmarks.automaton_intake               # a 30 MB automaton (ORDER's size)
    python -m benchmarks.automaton_intake --mb 13
"""

from __future__ import annotations

import argparse
import hashlib
import time
from array import array
from collections.abc import Callable

from benchmarks.common import best_of, record
from dpu_frontend.config import REFERENCE_GEOMETRY, PeerConfig
from dpu_frontend.peer.reference import ReferenceKernel
from dpu_frontend.ring import DpuChannel, GpuChannel, SamplingParams
from dpu_frontend.ring.automaton import (
    Constraint,
    TokenAutomaton,
    decode_automaton,
    encode_automaton,
)
from dpu_frontend.ring.memory import AtomicMemory
from tests.unit.interleave import apply

VOCAB, EOS = 151_669, 151_645


def dense_chain(megabytes: float) -> TokenAutomaton:
    """Dense states, each allowing all but a few ids and going on to the next, the last
    one looping and allowing the end: about ``megabytes`` of bitmasks."""
    words = (VOCAB + 31) // 32
    states = max(2, int(megabytes * 2**20 / (4 * words)))
    mask = [0xFFFF_FFFF] * words
    mask[-1] = (1 << (VOCAB % 32)) - 1
    masks = array("I", mask * states)
    return TokenAutomaton(VOCAB, EOS, array("i", [0] * (states + 1)), array("i"), array("i"),
                          array("i", [min(s + 1, states - 1) for s in range(states)]),
                          array("i", [s * words for s in range(states)]), masks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=30.0, help="the automaton's size, MB")
    ap.add_argument("--requests", type=int, default=8,
                    help="later requests of it, each way (the fastest is reported)")
    args = ap.parse_args(argv)

    encoded = encode_automaton(dense_chain(args.mb), key=0x5EED)
    decode_automaton(encoded, VOCAB)  # a valid one: the first request's check passes
    layout = REFERENCE_GEOMETRY.plan(instance=1)
    ch = layout.channels[0]
    mem = AtomicMemory(bytearray(layout.region_size))
    gpu = GpuChannel(mem, ch)
    gpu.reset(1)
    dpu = DpuChannel(ch, epoch=1)
    params = SamplingParams(max_tokens=1)
    constraint = Constraint(encoded)
    kernel = ReferenceKernel(PeerConfig(geometry=REFERENCE_GEOMETRY), [], (EOS,),
                             vocab_size=VOCAB)
    request_id = 0

    def one_request(take: Callable[[], None]) -> float:
        """One constrained request through the ring (the arena holds one automaton of
        this size at a time); seconds of ``take``, the GPU side's intake of it."""
        nonlocal request_id
        request_id += 1
        dpu.submit(request_id, [1, 2, 3], params, constraint)
        writes, _ = dpu.take_writes()
        for op in writes:
            apply(mem, op)
        began = time.perf_counter()
        take()
        took = time.perf_counter() - began
        poll = dpu.begin_poll()  # the DPU learns the request was consumed
        for op in poll.writes:
            apply(mem, op)
        dpu.end_poll(poll, [mem.read(r.offset, r.length) for r in poll.reads], time.monotonic())
        return took

    def intake() -> None:
        for taken in gpu.poll_requests(kernel._cached):
            assert (taken.checked or kernel._checked(taken.identity, taken.automaton)) is not None

    def hashed() -> None:
        """The earlier path: every automaton copied out and hashed, then looked up."""
        for taken in gpu.poll_requests(None):
            hashlib.blake2b(taken.automaton, digest_size=16).digest()
            assert kernel._cached(taken.identity) is not None

    first = one_request(intake)  # copies and checks it
    cached = min(one_request(intake) for _ in range(args.requests))
    before = min(one_request(hashed) for _ in range(args.requests))
    offset = layout.channels[0].arena_offset
    def copy_out() -> None:
        mem.read(offset, len(encoded))

    bare = best_of(copy_out, repeat=5)
    record("automaton_intake", {
        "automaton, MB": round(len(encoded) / 2**20, 2),
        "first request (copy out and check), ms": round(first * 1e3, 1),
        "a later request, its copy found by identity, ms": round(cached * 1e3, 3),
        "a later request, copied out and hashed (before), ms": round(before * 1e3, 1),
        "bare limit: one copy of its bytes out of the region, ms": round(bare * 1e3, 1),
    })
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
