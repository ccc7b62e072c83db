"""``model-peer --scheduler gpu``: the engine loop inside the GPU, behind the daemon.

test_model_serving.py runs its SDK scenarios against this peer too (the tokens of
every sampler stage equal the host engine's, log probabilities, cancels). Here: a
KV cache too small for the load (preemption, admission waiting), a thousand
concurrent streams, the launcher killed with ``kill -9`` and restarted, and the
host's share of the work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import pytest

from dpu_frontend.config import ServeConfig
from dpu_frontend.control.stats import peer_report
from dpu_frontend.engine.session import PeerSession
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.ring.automaton import (
    CheckedAutomaton,
    Constraint,
    TokenAutomaton,
    build_automaton,
    encode_automaton,
)
from dpu_frontend.ring.records import FinishReason, ResponseRecord, SamplingParams
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.tokenizer import Vocabulary
from tests.integration.scenarios import check_peer_killed_mid_stream
from tests.raw_ring import poll_until_final, write_constrained, write_unknown_kind
from tests.stack import MODEL, Stack, running_stack

pytestmark = pytest.mark.gpu

SEED = 20261127
TIMEOUT = 600  # model load, graph captures and the first nvcc build
RING = ("--max-sequences", "1024", "--resp-slots", "2048")
#: 20 KV blocks of 32 tokens: 640 tokens for requests that want up to 250 each.
SMALL_KV = ("--scheduler", "gpu", "--max-seqs", "16", "--max-model-len", "512", "--kv-blocks",
            "20", "--weight-seed", str(SEED), *RING)
WIDE = ("--scheduler", "gpu", "--max-seqs", "256", "--max-model-len", "1024", "--kv-blocks",
        "2048", "--weight-seed", str(SEED), *RING)


#: The host-driven engine's sizes (conftest's ``offline``, on the same weights).
OFFLINE = {"num_blocks": 128, "max_seqs": 16, "max_model_len": 512}


async def report(stack: Stack) -> dict[str, Any]:
    return await peer_report(stack.peer_address())


async def complete(session: aiohttp.ClientSession, stack: Stack, body: dict[str, Any]
                   ) -> dict[str, Any]:
    async with session.post(f"{stack.base_url}/v1/completions", json={"model": MODEL, **body}) as r:
        answer: dict[str, Any] = await r.json()
        assert r.status == 200, answer
        return answer


@contextlib.asynccontextmanager
async def raw_channel(*peer_args: str) -> AsyncIterator[tuple[Stack, PeerSession]]:
    """The GPU scheduler behind a daemon, with a second channel that a raw client (the
    session) drives, to write what a daemon never does."""
    with running_stack("shm", timeout=TIMEOUT, peer_command="model-peer",
                       peer_args=(*SMALL_KV, "--channels", "2", *peer_args)) as stack:
        address = stack.peer_address()
        session = await PeerSession.connect(ServeConfig(peers=(address,), transport="shm"),
                                            address)
        try:
            yield stack, session
        finally:
            await session.close()


async def until_final(session: PeerSession, requests: Sequence[int]) -> list[ResponseRecord]:
    """Every record the channel publishes until each of ``requests`` has its final one."""
    seen: list[ResponseRecord] = []
    for request in requests:
        if not any(r.request_id == request and r.final for r in seen):
            seen += await poll_until_final(session, request, limit=120)
    return seen


async def test_kv_exhaustion_preempts_and_waits_and_changes_no_token(
        offline: ModelEngine) -> None:
    """Twelve greedy requests of up to 250 tokens each against a 640-token cache: the
    scheduler admits what fits, preempts the youngest when a decode finds no block,
    recomputes it later; every answer is the host engine's, token for token."""
    vocab = Vocabulary.load(default_tokenizer_dir())
    prompts = [f"Request {i} asks the scheduler inside the GPU for room." * (1 + i % 3)
               for i in range(12)]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    expected = offline.generate([vocab.encode(p) for p in prompts], [params] * len(prompts))
    with running_stack("shm", timeout=TIMEOUT, peer_command="model-peer",
                       peer_args=SMALL_KV) as stack:
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(*(complete(session, stack, {
                "prompt": p, "max_tokens": 200, "temperature": 0.0, "ignore_eos": True})
                for p in prompts))
        kernel = (await report(stack))["kernel"]
    for answer, want in zip(answers, expected, strict=True):
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 200
        assert answer["choices"][0]["text"] == vocab.decode(want.tokens)
    assert kernel["scheduler"] == "gpu"
    assert kernel["preemptions"] > 0, kernel
    assert kernel["running"] == 0 and kernel["waiting"] == 0 and kernel["free_blocks"] == 20
    # Each work reads its context and its own tokens: more positions than tokens in all.
    assert kernel["context_tokens"] > kernel["tokens"] > 0, kernel
    # The decodes were scheduled over the block in some steps and by thread 0's serial
    # loop in the steps that preempted: both ways, the host engine's tokens.
    assert 0 < kernel["spread_schedules"] < kernel["steps"], kernel
    print(f"12 requests in a 640-token cache: {kernel['preemptions']} preemptions, "
          f"{kernel['steps']} steps, every answer the host engine's")


async def test_a_thousand_concurrent_streams() -> None:
    streams = 1000

    async def one(session: aiohttp.ClientSession, stack: Stack, i: int) -> tuple[str, int]:
        body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 24, "ignore_eos": True,
                "temperature": 1.0, "seed": i, "stream": True,
                "stream_options": {"include_usage": True}}
        finish, tokens = "", 0
        async with session.post(f"{stack.base_url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for raw in resp.content:
                line = raw.decode().strip().removeprefix("data: ")
                if not line or line == "[DONE]":
                    continue
                chunk = json.loads(line)
                if chunk.get("choices") and chunk["choices"][0]["finish_reason"]:
                    finish = chunk["choices"][0]["finish_reason"]
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return finish, tokens

    with running_stack("shm", timeout=TIMEOUT, peer_command="model-peer",
                       peer_args=WIDE) as stack:
        started = time.monotonic()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            results = await asyncio.gather(*(one(session, stack, i) for i in range(streams)))
        took = time.monotonic() - started
        kernel = (await report(stack))["kernel"]
    assert results == [("length", 24)] * streams
    assert kernel["sampled"] >= streams * 24 and kernel["running"] == 0
    assert kernel["spread_schedules"] > kernel["steps"] // 2, kernel  # full batches, room
    print(f"{streams} concurrent streams of 24 tokens through the GPU scheduler in {took:.1f} s: "
          f"{kernel['steps']} steps, {kernel['sampled']} tokens drawn")


async def test_launcher_killed_and_restarted_gives_a_new_epoch(
        healthy: Callable[[Stack], Awaitable[None]]) -> None:
    """kill -9 of the launcher while the scheduler runs: the daemon ends the open
    stream with an error and refuses the waiting request; the restarted launcher
    (the GPU usable again) serves a new epoch."""
    with running_stack("shm", timeout=TIMEOUT, peer_command="model-peer",
                       peer_args=SMALL_KV) as stack:
        first = (await report(stack))["channels"][0]
        await check_peer_killed_mid_stream(stack, max_tokens=400)
        stack.peers[0].restart()
        await healthy(stack)
        async with aiohttp.ClientSession() as session:
            second = (await report(stack))["channels"][0]
            assert second["attached"] and second["epoch"] != first["epoch"]
            answer = await complete(session, stack, {"prompt": "After the restart",
                                                     "max_tokens": 16, "temperature": 0.0})
        assert answer["choices"][0]["finish_reason"] in ("length", "stop")
    print(f"launcher killed and restarted: epoch {first['epoch']} -> {second['epoch']}, served")


async def test_the_host_is_out_of_the_token_path() -> None:
    """While 64 streams run, the launcher process's CPU time grows by a small fraction of
    a core: it answers the control plane only (the benchmark measures it per 1,000
    tokens; this checks the mode, not a figure)."""
    with running_stack("shm", timeout=TIMEOUT, peer_command="model-peer",
                       peer_args=WIDE) as stack:
        pid = stack.peer.pid

        def cpu_s() -> float:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks

        before, t0 = cpu_s(), time.monotonic()
        async with aiohttp.ClientSession() as session:
            answers = await asyncio.gather(*(complete(session, stack, {
                "prompt": f"host {i}", "max_tokens": 256, "ignore_eos": True, "seed": i})
                for i in range(64)))
        used, wall = cpu_s() - before, time.monotonic() - t0
        kernel = (await report(stack))["kernel"]
    tokens = sum(a["usage"]["completion_tokens"] for a in answers)
    assert tokens == 64 * 256
    assert used < 0.25 * wall, (used, wall)
    print(f"{tokens} tokens in {wall:.2f} s; the launcher used {used:.3f} s of CPU "
          f"({1000 * used / tokens * 1000:.2f} ms per 1,000 tokens), {kernel['steps']} steps")


def test_sigterm_stops_the_scheduler() -> None:
    with running_stack("shm", timeout=TIMEOUT, peer_command="model-peer",
                       peer_args=SMALL_KV) as stack:
        stack.peer.send_signal(signal.SIGTERM)
        assert stack.peer.wait(timeout=60) == 0


async def test_bad_and_refused_records_on_a_raw_channel(offline: ModelEngine) -> None:
    """A raw client on a second channel writes what a daemon never does: a record of an
    unknown kind, one flagged CONSTRAINED on rings that offer no automata
    (--max-automaton-bytes 0) and a second GENERATE with a running request's id are
    counted bad and skipped, a prompt
    holding an id past the vocabulary ends with an error record (the request fails
    alone), and a request after them is answered as the host engine answers it. The
    scheduler's intake (the ring's shared walk) takes each in turn."""
    async with raw_channel("--max-automaton-bytes", "0") as (stack, session):
        before = await report(stack)
        await write_unknown_kind(session, 1, [11, 12, 13])
        await write_constrained(session, 5, [51, 52])  # no automata on this layout
        running = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
        session.channel.submit(2, [21, 22, 23], running)
        session.channel.submit(2, [24, 25], running)  # its id is running: bad
        session.channel.submit(3, [31, 1 << 30], SamplingParams(max_tokens=4))
        greedy = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        session.channel.submit(4, [41, 42, 43], greedy)
        seen = await until_final(session, (3, 4, 2))
        after = await report(stack)
        refused = [r for r in seen if r.request_id == 3]
        assert [(r.finish, r.tokens) for r in refused] == [(FinishReason.ERROR, ())]
        want = offline.generate([[41, 42, 43]], [greedy])[0].tokens
        assert [t for r in seen if r.request_id == 4 for t in r.tokens] == want
        assert [t for r in seen if r.request_id == 2 for t in r.tokens] == \
            offline.generate([[21, 22, 23]], [running])[0].tokens
        mine = session.channel_index
        was, now = before["channels"][mine], after["channels"][mine]
        assert not [r for r in seen if r.request_id == 5]
        assert now["bad_records"] == was["bad_records"] + 3
        assert now["records"] == was["records"] + 6
        assert after["kernel"]["refused"] == before["kernel"]["refused"] + 1
        async with aiohttp.ClientSession() as http:  # the daemon's channel still serves
            answer = await complete(http, stack, {"prompt": "After them", "max_tokens": 8,
                                                  "temperature": 0.0})
        assert answer["usage"]["completion_tokens"] >= 1
    print("unknown kind, a constrained record and duplicate id counted bad, an id past the "
          "vocabulary refused with an error record, the requests around them served as the "
          "host engine")


def choice_automaton(key: int) -> tuple[CheckedAutomaton, bytes]:
    """One of three token sequences, then the model's EOS; encoded with ``key``."""
    eos = ModelConfig.default().eos_token_ids[0]
    vocab = Vocabulary.load(default_tokenizer_dir()).tokenizer.get_vocab_size()
    transitions = {0: {1000: 1, 4000: 3}, 1: {2000: 2, 2500: 2}, 2: {eos: 2},
                   3: {4100: 4}, 4: {4200: 2}}
    a = build_automaton(transitions, 0, vocab, eos)
    return CheckedAutomaton.of(a), encode_automaton(a, key=key)


async def test_automata_on_a_raw_channel(offline: ModelEngine) -> None:
    """Structured output inside the GPU: a constrained request's automaton copied out of
    the arena, checked and walked by the sampler graphs, gives the host engine's tokens
    for the same automaton; a second request of the same key walks the same copy; one
    whose automaton fails a check (a next state out of range) ends with an error record
    and is counted bad; an unconstrained request beside them is untouched."""
    checked, encoded = choice_automaton(key=7)
    broken = bytearray(encode_automaton(checked.automaton, key=8))
    states = checked.automaton.states
    # The first list_next word (after the header, list_start [S + 1], list_tokens [L]).
    at = 64 + 4 * (states + 1 + len(checked.automaton.list_tokens))
    broken[at:at + 4] = (states + 5).to_bytes(4, "little")
    async with raw_channel() as (stack, session):
        before = await report(stack)
        params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=0.9, seed=3)]
        session.channel.submit(1, [11, 12, 13], params[0], Constraint(encoded))
        session.channel.submit(2, [21, 22], params[1], Constraint(encoded))
        session.channel.submit(3, [31, 32], params[0], Constraint(bytes(broken)))
        plain = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0)
        session.channel.submit(4, [41, 42, 43], plain)
        seen = await until_final(session, (1, 2, 3, 4))
        after = await report(stack)

    def answer(request: int) -> tuple[list[int], FinishReason]:
        mine = [r for r in seen if r.request_id == request]
        return [t for r in mine for t in r.tokens], mine[-1].finish

    for request, prompt, p in ((1, [11, 12, 13], params[0]), (2, [21, 22], params[1])):
        offline.add(0, prompt, p, automaton=checked)
        want: list[int] = []
        finish = FinishReason.NONE
        while not offline.idle:
            for ev in offline.step():
                want += [] if ev.token is None else [ev.token]
                finish = ev.finish
        tokens, end = answer(request)
        assert (tokens, end) == (want, finish), request
        assert end is FinishReason.STOP and checked.automaton.walk(tokens) is not None
    assert answer(3) == ([], FinishReason.ERROR)
    assert answer(4)[0] == offline.generate([[41, 42, 43]], [plain])[0].tokens
    was, now = before["kernel"], after["kernel"]
    assert now["automata_copied"] == was["automata_copied"] + 1  # one copy for two requests
    assert now["constrained"] == was["constrained"] + 2
    assert now["automata_refused"] == was["automata_refused"] + 1
    mine = session.channel_index
    assert after["channels"][mine]["bad_records"] == before["channels"][mine]["bad_records"] + 1
    print(f"GPU scheduler: a choice automaton walked inside the GPU ({answer(1)[0]}, "
          f"{answer(2)[0]}), the host engine's tokens; one copy for two requests; a broken "
          "automaton refused with an error record")


async def test_malformed_automata_on_a_raw_channel() -> None:
    """What a faulty DPU could send on a channel that takes automata, each answered with
    an error record and counted bad, never walked: a dense state whose only bits lie
    past the vocabulary (it would allow nothing), and sizes no automaton has (below a
    header; not whole words)."""
    vocab = Vocabulary.load(default_tokenizer_dir()).tokenizer.get_vocab_size()
    eos = ModelConfig.default().eos_token_ids[0]
    words = (vocab + 31) // 32
    spare = [0] * words
    spare[-1] = 1 << 31  # past the vocabulary (its last word's tail)
    past = encode_automaton(TokenAutomaton(vocab, eos, array("i", [0, 0]), array("i"),
                                           array("i"), array("i", [0]), array("i", [0]),
                                           array("I", spare)), key=9)
    async with raw_channel() as (stack, session):
        before = await report(stack)
        session.channel.submit(1, [11, 12], SamplingParams(max_tokens=4), Constraint(past))
        await write_constrained(session, 2, [21, 22], automaton_bytes=60)
        await write_constrained(session, 3, [31, 32], automaton_bytes=66)
        seen = await until_final(session, (1, 2, 3))
        after = await report(stack)
    for request in (1, 2, 3):
        assert [(r.finish, r.tokens) for r in seen if r.request_id == request] == \
            [(FinishReason.ERROR, ())], request
    mine = session.channel_index
    assert after["channels"][mine]["bad_records"] == before["channels"][mine]["bad_records"] + 3
    assert after["kernel"]["automata_refused"] == before["kernel"]["automata_refused"] + 3
    print("bits past the vocabulary, a size below a header, a size of no whole words: each "
          "an error record and a bad count")
