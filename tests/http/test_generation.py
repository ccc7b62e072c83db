"""The HTTP layer and ``Service`` in memory: the request lifecycle, decided by the test.

Each behaviour here once needed real processes and sleeps; the loopback GPU
now answers exactly when the test says, through the real app and a real
socket.
"""

from __future__ import annotations

import asyncio
import re
import threading

import pytest

from dpu_frontend.errors import TransportError
from dpu_frontend.ring import FinishReason, Geometry
from dpu_frontend.text.tokenizer import Vocabulary
from tests.engine.loopback import LoopbackGpu
from tests.http.conftest import MODEL, Factory, events, ids, next_event

LONG = {"model": MODEL, "prompt": "Tell me everything.", "max_tokens": 1000, "stream": True}


async def test_n_choices_are_merged_each_with_its_own_text(
        make_frontend: Factory, vocab: Vocabulary) -> None:
    front = await make_frontend()
    resp = await front.client.post("/v1/completions", json=LONG | {"n": 3, "seed": 7})
    assert resp.status == 200
    arrivals = await front.gpu.wait_for(3)
    assert [a.record.params.seed for a in arrivals] == [7, 8, 9]  # seed + j
    texts = {0: " red", 1: " green", 2: " blue"}
    first, second, third = (a.record.request_id for a in arrivals)
    # Interleaved, and not in choice order.
    front.gpu.emit(third, ids(vocab, " blue"))
    front.gpu.emit(first, ids(vocab, " red"))
    front.gpu.finish(third, finish=FinishReason.LENGTH)
    front.gpu.emit(second, ids(vocab, " green"))
    front.gpu.finish(first)
    front.gpu.finish(second)
    got: dict[int, str] = {}
    finish: dict[int, str] = {}
    for event in await events(resp):
        (choice,) = event["choices"]
        got[choice["index"]] = got.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert got == texts
    assert finish == {0: "stop", 1: "stop", 2: "length"}


async def test_n_choices_collected_report_usage_over_all(
        make_frontend: Factory, vocab: Vocabulary) -> None:
    front = await make_frontend()
    request = asyncio.create_task(front.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": [11, 12], "max_tokens": 4, "n": 2}))
    for arrival in await front.gpu.wait_for(2):
        front.gpu.finish(arrival.record.request_id, (20, 21, 22), FinishReason.LENGTH)
    resp = await request
    body = await resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    # The prompt counts once, as OpenAI counts it; the completions of every choice add up.
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}


async def test_a_client_that_disconnects_cancels_on_the_gpu(
        make_frontend: Factory, vocab: Vocabulary) -> None:
    front = await make_frontend()
    resp = await front.client.post("/v1/completions", json=LONG)
    (arrival,) = await front.gpu.wait_for(1)
    front.gpu.emit(arrival.record.request_id, ids(vocab, " Hello"))
    assert (await next_event(resp))["choices"][0]["text"]
    resp.close()  # mid-stream
    await front.gpu.wait_for(1, cancels=1)
    assert front.gpu.cancels == [arrival.record.request_id]
    front.gpu.finish(arrival.record.request_id, finish=FinishReason.CANCELLED)
    await front.service.pool.wait_idle()
    while not front.aborted("client_disconnected"):  # the handler's cleanup, after its cancel
        await front.gpu.wait_exchanges(1)
    assert front.aborted("client_disconnected") == 1


async def test_a_failing_peer_ends_the_stream_with_an_error_event(
        make_frontend: Factory, vocab: Vocabulary) -> None:
    front = await make_frontend()
    resp = await front.client.post("/v1/completions", json=LONG)
    (arrival,) = await front.gpu.wait_for(1)
    front.gpu.emit(arrival.record.request_id, ids(vocab, " Hello"))
    assert "error" not in await next_event(resp)
    front.peer.refusal = TransportError("cannot reach GPU peer: connection refused")
    front.gpu.failure = TransportError("RDMA completion error IBV_WC_REM_ACCESS_ERR")
    rest = await events(resp)
    assert rest[-1]["error"]["type"] == "service_unavailable"
    assert "REM_ACCESS_ERR" in rest[-1]["error"]["message"]
    # Down now: a new request gets 503 with Retry-After, and /health says why.
    refused = await front.client.post("/v1/completions", json=LONG | {"stream": False})
    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
    health = await front.client.get("/health")
    assert health.status == 503
    # The failure, or the refused reconnect after it: whichever came last.
    assert re.search("REM_ACCESS_ERR|connection refused",
                     (await health.json())["peers"][0]["error"])


async def test_admission_refuses_past_the_queue_while_the_ring_is_full(
        make_frontend: Factory) -> None:
    front = await make_frontend(max_queued_requests=1)
    front.peer.geometry = Geometry(req_slots=1, arena_bytes=4096, resp_slots=4, max_sequences=1)
    front.gpu.hung_up.set()  # reconnect with one sequence per channel
    await (await front.peer.wait_sessions(2)).wait_exchanges(1)
    running = await front.client.post("/v1/completions", json=LONG)
    await front.gpu.wait_for(1)
    waiting = asyncio.create_task(front.client.post("/v1/completions", json=LONG))
    link = front.service.pool.links[0]
    while link.channel is None or link.channel.queued == 0:
        await front.gpu.wait_exchanges(1)
    refused = await front.client.post("/v1/completions", json=LONG)
    assert refused.status == 429 and refused.headers["Retry-After"] == "1"
    assert (await refused.json())["error"]["code"] == "overloaded"
    running.close()
    (await waiting).close()


async def test_equal_loads_alternate_between_peers(make_frontend: Factory) -> None:
    front = await make_frontend(peers=2)
    gpus = [p.gpu for p in front.peers.values()]
    body = {"model": MODEL, "prompt": [5], "max_tokens": 1}
    for _ in range(4):  # one after another: never two open at once
        answer = asyncio.create_task(front.client.post("/v1/completions", json=body))
        gpu, request_id = await next_arrival(gpus)
        gpu.finish(request_id, (6,), FinishReason.LENGTH)
        assert (await answer).status == 200
    assert [len(gpu.arrivals) for gpu in gpus] == [2, 2]


async def next_arrival(gpus: list[LoopbackGpu]) -> tuple[LoopbackGpu, int]:
    """The next generate to reach any of ``gpus``."""
    waits = {asyncio.create_task(gpu.wait_for(len(gpu.arrivals) + 1)): gpu for gpu in gpus}
    done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    gpu = waits[done.pop()]
    return gpu, list(gpu.arrivals)[-1]


async def test_tokenizing_a_huge_prompt_does_not_hold_up_the_others(
        make_frontend: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokenizing runs off the event loop: while one prompt is still being tokenized,
    another request is served from start to end."""
    front = await make_frontend()
    service = front.service
    entered, release = threading.Event(), threading.Event()
    encode = service._encode

    def slow_encode(text: str, add_special_tokens: bool) -> list[int]:
        if text.startswith("huge"):
            entered.set()
            release.wait(timeout=60)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(service, "_encode", slow_encode)
    huge = asyncio.create_task(front.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "huge " * 1000, "max_tokens": 1}))
    await asyncio.to_thread(entered.wait, 60)
    quick = asyncio.create_task(front.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "quick", "max_tokens": 1}))
    (arrival,) = await front.gpu.wait_for(1)
    front.gpu.finish(arrival.record.request_id, (7,), FinishReason.LENGTH)
    assert (await quick).status == 200
    assert not huge.done()  # still tokenizing
    release.set()
    (_, arrival) = await front.gpu.wait_for(2)
    front.gpu.finish(arrival.record.request_id, (7,), FinishReason.LENGTH)
    assert (await huge).status == 200


async def test_the_records_of_one_poll_go_out_in_one_write_and_their_delay_is_counted(
        make_frontend: Factory, vocab: Vocabulary) -> None:
    """Records that came in the same poll make one event each, written together; the
    delivery histogram holds one sample a write (the daemon's own share of latency)."""
    front = await make_frontend()
    resp = await front.client.post("/v1/completions", json=LONG)
    (arrival,) = await front.gpu.wait_for(1)
    request_id = arrival.record.request_id
    for word in (" red", " green", " blue"):  # before the handler runs: one batch
        front.gpu.emit(request_id, ids(vocab, word))
    front.gpu.finish(request_id, finish=FinishReason.LENGTH)
    got = await events(resp)
    assert [e["choices"][0]["text"] for e in got] == [" red", " green", " blue", ""]
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    await front.service.pool.wait_idle()
    count = front.metrics.registry.get_sample_value("dpu_frontend_delivery_seconds_count")
    total = front.metrics.registry.get_sample_value("dpu_frontend_delivery_seconds_sum")
    assert count is not None and 1 <= count <= 4 and total is not None and 0 <= total < 5


@pytest.mark.parametrize("at_start", [True, False], ids=["at-start", "on-first-use"])
async def test_the_constraint_compiler_starts_with_the_worker_unless_told_not_to(
        make_frontend: Factory, at_start: bool) -> None:
    """``warm_up`` starts the compiler's process without waiting for it (the first
    constrained request would otherwise wait for its start and vocabulary); with
    ``constraint_compiler_at_start`` off, nothing starts until a compile does."""
    front = await make_frontend(constraint_compiler_at_start=at_start)
    service = front.service
    try:
        await service.warm_up()
        # The start runs on the compiler's one thread: anything queued after it runs
        # once it is done.
        await asyncio.get_running_loop().run_in_executor(service._compile_executor, int)
        assert (service._compiler is not None and service._compiler.running) == at_start
    finally:
        service.close()
