"""The CUDA peer end to end: daemon (shm transport) -> rings in host memory mapped into the
GPU -> the persistent kernel, and back. Run on a GPU machine (docs/gpu.md).

These tests share one stack for the module; test_cuda_peer_lifecycle.py starts its own,
one at a time: two processes with persistent kernels on one GPU time-slice it, and a
heartbeat can then stall past the daemon's timeout (docs/gpu.md, "One peer per GPU")."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, Sequence
from typing import Any

import aiohttp
import pytest

from dpu_frontend.config import PeerAddress, ServeConfig
from dpu_frontend.control.stats import peer_stats
from dpu_frontend.engine.session import PeerSession
from dpu_frontend.ring import FinishReason, ResponseRecord, SamplingParams
from dpu_frontend.ring.automaton import CheckedAutomaton, Constraint, encode_automaton
from dpu_frontend.text.constraints import ConstraintCompiler, ConstraintSpec
from tests.integration.scenarios import (
    SENTENCE_REGEX,
    check_chat_stream_sdk,
    check_constrained_equals_the_reference,
    check_stream_equals_full_and_decode,
    load_vocab,
    replay_answers,
)
from tests.raw_ring import poll_until_final, write_constrained, write_unknown_kind
from tests.stack import MODEL, Stack, running_stack

pytestmark = pytest.mark.gpu

TIMEOUT = 300  # the first start builds the kernel with nvcc
GPU_ARGS = ("--max-sequences", "1024", "--resp-slots", "2048")
#: The shared stack's daemon takes channel 0; the raw clients of the automata and the
#: corrupt-record tests one each of the others, since the peer may not yet have seen
#: the first client leave when the second asks (a refusal: "no free channel").
SHARED_ARGS = (*GPU_ARGS, "--channels", "3")


@pytest.fixture(scope="module")
def gpu_stack() -> Iterator[Stack]:
    with running_stack("shm", timeout=TIMEOUT, peer_command="gpu-peer",
                       peer_args=SHARED_ARGS) as stack:
        yield stack


async def channel(stack: Stack) -> dict[str, Any]:
    return (await peer_stats(stack.peer_address()))[0]


# -- the SDK scenarios that run against the Python peer, unchanged ---------------------


async def test_sdk_completions_stream_equals_full_equals_the_reference(gpu_stack: Stack) -> None:
    await check_stream_equals_full_and_decode(gpu_stack)


async def test_sdk_chat_stream(gpu_stack: Stack) -> None:
    await check_chat_stream_sdk(gpu_stack)


async def test_a_thousand_concurrent_streams(gpu_stack: Stack) -> None:
    streams = 1000

    async def one(session: aiohttp.ClientSession, i: int) -> tuple[int, str]:
        body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 32, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with session.post(f"{gpu_stack.base_url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            events = [raw.decode().strip().removeprefix("data: ")
                      async for raw in resp.content if raw.strip()]
        assert events[-1] == "[DONE]"
        usage = json.loads(events[-2])["usage"]
        finish = [json.loads(e)["choices"][0]["finish_reason"] for e in events[:-2]
                  if json.loads(e)["choices"]]
        return usage["completion_tokens"], finish[-1]

    connector = aiohttp.TCPConnector(limit=streams)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        results = await asyncio.gather(*(one(session, i) for i in range(streams)))
    assert results == [(32, "length")] * streams


async def test_sdk_constrained_answer_is_the_reference_walk(gpu_stack: Stack) -> None:
    """Structured output through the CUDA peer: the daemon's automaton walked by the
    kernel's replay gives the Python peer's answer, streamed and not."""
    await check_constrained_equals_the_reference(gpu_stack)


def answer(seen: Sequence[ResponseRecord], request: int) -> tuple[list[int], FinishReason]:
    mine = [r for r in seen if r.request_id == request]
    return [t for r in mine for t in r.tokens], mine[-1].finish


async def test_automata_on_a_raw_channel(gpu_stack: Stack) -> None:
    """The kernel's walk of an automaton (the sentence regex's) against the Python
    peer's, request by request, each different (the Python walk gives 'Soft to t turns',
    'St t t', 'Streaming text is harder', 'Operators care about a': the replay's words
    where allowed, the shortest ones where not): a budget that leaves room, one of 3
    tokens that forces the shortest way and ends at the length, ignore_eos, a seed and
    5 tokens; the four share one copy in the pool. A fifth, the same automaton with a
    next state out of range under another key, fails the kernel's check: an error
    record, counted bad. A plain request beside them is served."""
    vocab = load_vocab()
    compiled = ConstraintCompiler(vocab.tokenizer, vocab.eos_token_ids[0]).compile(
        ConstraintSpec.regex(SENTENCE_REGEX))
    checked, encoded = CheckedAutomaton.of(compiled), encode_automaton(compiled, key=11)
    broken = bytearray(encode_automaton(compiled, key=12))
    at = 64 + 4 * (compiled.states + 1 + len(compiled.list_tokens))  # the first list_next
    broken[at:at + 4] = (compiled.states + 5).to_bytes(4, "little")
    prompts = [[101, 102, 103], [201, 202], [301], [401, 402, 403, 404]]
    params = [SamplingParams(max_tokens=40), SamplingParams(max_tokens=3),
              SamplingParams(max_tokens=20, ignore_eos=True), SamplingParams(max_tokens=5, seed=5)]
    address = gpu_stack.peer_address()
    session = await PeerSession.connect(ServeConfig(peers=(address,), transport="shm"), address)
    try:
        before = (await peer_stats(address))[session.channel_index]
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            session.channel.submit(i + 1, prompt, p, Constraint(encoded))
        session.channel.submit(5, [501, 502], params[0], Constraint(bytes(broken)))
        session.channel.submit(6, [601, 602], SamplingParams(max_tokens=4, ignore_eos=True))
        seen: list[ResponseRecord] = []
        for request in range(1, 7):
            if not any(r.request_id == request and r.final for r in seen):
                seen += await poll_until_final(session, request, limit=120)
        after = (await peer_stats(address))[session.channel_index]
    finally:
        await session.close()
    want = replay_answers(vocab, prompts, params, checked)
    assert [answer(seen, i + 1) for i in range(4)] == want
    assert len({tuple(tokens) for tokens, _ in want}) == 4  # four different walks
    assert [finish for _, finish in want] == [FinishReason.STOP, FinishReason.LENGTH,
                                              FinishReason.STOP, FinishReason.STOP]
    for tokens, _ in want[:1] + want[2:]:
        assert checked.automaton.walk(tokens) is not None
    assert answer(seen, 5) == ([], FinishReason.ERROR)
    assert len(answer(seen, 6)[0]) == 4
    assert after["bad_records"] == before["bad_records"] + 1
    print(f"CUDA peer: the word regex walked in the kernel's replay ({want[0][0]} ...), the "
          "Python peer's tokens; a broken automaton answered with an error record")


async def test_a_corrupt_record_is_counted_and_skipped(gpu_stack: Stack) -> None:
    """A raw client on a second channel writes a record of an unknown kind, one flagged
    CONSTRAINED with an automaton's size and no automaton (a header of zeros), then a
    valid one: the kernel counts the first two bad, answers the second with an error
    record, serves the third, and goes on serving."""
    address = gpu_stack.peer_address()
    config = ServeConfig(peers=(address,), transport="shm")
    session = await PeerSession.connect(config, address)
    try:
        before = (await peer_stats(address))[session.channel_index]
        await write_unknown_kind(session, 1, [1, 2, 3])
        await write_constrained(session, 3, [7, 8])
        session.channel.submit(2, [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
        records = await poll_until_final(session, 2)
        if not any(r.request_id == 3 and r.final for r in records):
            records += await poll_until_final(session, 3)
        assert [t for r in records if r.request_id == 2 for t in r.tokens]
        assert answer(records, 3) == ([], FinishReason.ERROR)
        after = (await peer_stats(address))[session.channel_index]
        assert after["bad_records"] == before["bad_records"] + 2
        assert after["records"] == before["records"] + 3
    finally:
        await session.close()
    await check_stream_equals_full_and_decode(gpu_stack)  # the kernel still serves


def test_peer_stats_cli_reports_kernel_counters(gpu_stack: Stack) -> None:
    stats = asyncio.run(peer_stats(PeerAddress.parse(gpu_stack.peers[0].address)))
    assert {"records", "bad_records", "ring_full_waits", "epoch", "kernel_steps"} <= set(stats[0])


