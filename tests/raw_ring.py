"""A DPU-side client that drives a session's ring by hand, as a link would, for tests
that must write what a daemon never writes (a corrupt record) or poll without a link."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from dpu_frontend.engine.session import PeerSession
from dpu_frontend.ring import ResponseRecord, SamplingParams
from dpu_frontend.ring.records import FLAG_CONSTRAINED, REQUEST_BODY_OFFSET, REQUEST_STRUCT

UNKNOWN_KIND = 9  # no request record kind has this value


async def write_patched(session: PeerSession, request_id: int, prompt: Sequence[int],
                        patch: Callable[[bytearray], None]) -> None:
    """Write ``request_id``'s generate record with its body changed by ``patch`` (the
    body's bytes, from its first). Records queued before it are written first, as they
    are: the body patched is this request's alone."""
    ring, transport = session.channel, session.transport
    queued, _ = ring.take_writes()
    if queued:
        await transport.write(queued)
    ring.submit(request_id, prompt, SamplingParams(max_tokens=4))
    writes, _ = ring.take_writes()
    (body,) = (op for op in writes if op.offset % 128 == REQUEST_BODY_OFFSET)
    patched = bytearray(body.data)
    patch(patched)
    await transport.write([op if op is not body else type(op)(op.offset, bytes(patched))
                           for op in writes])


async def write_unknown_kind(session: PeerSession, request_id: int,
                             prompt: Sequence[int]) -> None:
    """Write ``request_id``'s generate record with its kind byte set to an unknown kind."""

    def unknown(body: bytearray) -> None:
        body[0] = UNKNOWN_KIND

    await write_patched(session, request_id, prompt, unknown)


async def write_constrained(session: PeerSession, request_id: int,
                            prompt: Sequence[int], automaton_bytes: int = 64) -> None:
    """Write ``request_id``'s generate record flagged CONSTRAINED, with an automaton's
    size and no automaton: on a channel whose layout offers no automata, what a 2.2 GPU
    side without the feature must refuse, never serve unconstrained; on one that does,
    with a size no automaton has, what it must answer with an error."""

    def constrained(body: bytearray) -> None:
        flags = REQUEST_STRUCT.offset("flags") - REQUEST_BODY_OFFSET
        body[flags] |= FLAG_CONSTRAINED
        at = REQUEST_STRUCT.offset("automaton_bytes") - REQUEST_BODY_OFFSET
        body[at:at + 4] = automaton_bytes.to_bytes(4, "little")

    await write_patched(session, request_id, prompt, constrained)


async def poll_until_final(session: PeerSession, request_id: int,
                           limit: float = 30) -> list[ResponseRecord]:
    """Poll the ring as a link does until ``request_id``'s final record; every record seen."""
    ring, transport = session.channel, session.transport
    out: list[ResponseRecord] = []
    async with asyncio.timeout(limit):
        while not any(r.request_id == request_id and r.final for r in out):
            poll = ring.begin_poll()
            records, more = ring.end_poll(
                poll, await transport.exchange(poll.writes, poll.reads), time.monotonic())
            for op in more:
                records += ring.on_records(op, await transport.read(op))
            out += records
            await asyncio.sleep(0.001)  # a kernel's tick
    return out
