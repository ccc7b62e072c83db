"""Events written by the poll loop (``_DirectWriter``): a plain-text stream's records
reach the client without waking its handler, in order with those the handler writes,
and a failure there ends that stream only."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from dpu_frontend.http.generation import _DirectWriter
from dpu_frontend.ring import FinishReason
from dpu_frontend.text.tokenizer import Vocabulary
from tests.http.conftest import MODEL, Factory, events, ids, next_event

WORDS = (" red", " green", " blue", " yellow")
COMPLETION = {"model": MODEL, "prompt": "Colours?", "max_tokens": 1000, "stream": True}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Colours?"}],
        "max_tokens": 1000, "stream": True}


def text_of(event: dict[str, Any]) -> str:
    (choice,) = event["choices"]
    return str(choice["delta"].get("content", "") if "delta" in choice else choice["text"])


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts ``_DirectWriter.take`` wrote, in order."""
    texts: list[str] = []
    take = _DirectWriter.take

    def counted(self: _DirectWriter, delta: Any) -> None:
        texts.append(delta.text)
        take(self, delta)

    monkeypatch.setattr(_DirectWriter, "take", counted)
    return texts


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION),
                                            ("/v1/chat/completions", CHAT)])
async def test_records_of_one_poll_each_are_written_by_the_poll_loop(
        make_frontend: Factory, vocab: Vocabulary, taken: list[str], path: str,
        body: dict[str, Any]) -> None:
    front = await make_frontend()
    resp = await front.client.post(path, json=body)
    (arrival,) = await front.gpu.wait_for(1)
    request_id = arrival.record.request_id
    got = []
    for word in WORDS:  # a record a poll, each read before the next: a decode step's load
        front.gpu.emit(request_id, ids(vocab, word))
        event = await next_event(resp)
        while not text_of(event):  # chat's opening event: the role
            event = await next_event(resp)
        got.append(text_of(event))
    front.gpu.finish(request_id, finish=FinishReason.LENGTH)
    rest = await events(resp)
    assert got == list(WORDS) and rest[-1]["choices"][0]["finish_reason"] == "length"
    # The first event goes out through the handler, which then attaches the writer; the
    # last record wakes it to end the stream; those between were the poll loop's.
    assert taken == list(WORDS[1:])
    await front.service.pool.wait_idle()
    tokens = front.metrics.registry.get_sample_value("dpu_frontend_delivery_seconds_count")
    assert tokens is not None and tokens >= len(WORDS)


async def test_a_backed_up_connection_has_the_handler_write_and_the_order_holds(
        make_frontend: Factory, vocab: Vocabulary, taken: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """While the connection is not ready, records are buffered for the handler; those
    after them wait behind them even once it is ready again."""
    answers = iter([True, False, True, True, True])
    monkeypatch.setattr(_DirectWriter, "ready", lambda self: next(answers, True))
    front = await make_frontend()
    resp = await front.client.post("/v1/completions", json=COMPLETION)
    (arrival,) = await front.gpu.wait_for(1)
    request_id = arrival.record.request_id
    front.gpu.emit(request_id, ids(vocab, " first"))
    assert text_of(await next_event(resp)) == " first"  # the handler's, before attaching
    for word in WORDS:  # one poll: the 1st direct, the 2nd not ready, so the rest buffer
        front.gpu.emit(request_id, ids(vocab, word))
    front.gpu.finish(request_id, finish=FinishReason.LENGTH)
    rest = await events(resp)
    assert [text_of(e) for e in rest] == [*WORDS, ""]
    assert taken == [WORDS[0]]


@pytest.mark.parametrize("method", ["ready", "take"])
async def test_a_failure_in_the_poll_loops_write_ends_that_stream_only(
        make_frontend: Factory, vocab: Vocabulary, monkeypatch: pytest.MonkeyPatch,
        method: str) -> None:
    def broken(self: _DirectWriter, *delta: Any) -> None:
        raise RuntimeError("the writer broke")

    front = await make_frontend()
    resp = await front.client.post("/v1/completions", json=COMPLETION)
    (arrival,) = await front.gpu.wait_for(1)
    request_id = arrival.record.request_id
    front.gpu.emit(request_id, ids(vocab, " first"))
    assert text_of(await next_event(resp)) == " first"
    monkeypatch.setattr(_DirectWriter, method, broken)
    front.gpu.emit(request_id, ids(vocab, " second"))
    rest = await events(resp)
    assert rest[-1]["error"]["type"] == "internal_error"
    assert front.aborted("internal_error") == 1
    await front.gpu.wait_for(1, cancels=1)  # its generation is stopped on the GPU side
    assert front.gpu.cancels == [request_id]
    front.gpu.finish(request_id, finish=FinishReason.CANCELLED)
    # The poll loop went on: the next stream is served to its end.
    monkeypatch.undo()
    resp = await front.client.post("/v1/completions", json=COMPLETION)
    arrivals = await front.gpu.wait_for(2)
    front.gpu.finish(arrivals[-1].record.request_id, ids(vocab, " fine"), FinishReason.LENGTH)
    assert [text_of(e) for e in await events(resp)] == [" fine"]


async def test_streams_with_stop_strings_or_several_choices_are_the_handlers(
        make_frontend: Factory, vocab: Vocabulary, taken: list[str]) -> None:
    """A stop string can end a sequence on any record, and choices merge in tasks:
    neither is written from the poll loop."""
    front = await make_frontend()
    for extra, sequences in (({"stop": ["purple"]}, 1), ({"n": 2}, 2)):
        before = len(front.gpu.arrivals)
        resp = await front.client.post("/v1/completions", json=COMPLETION | extra)
        arrivals = (await front.gpu.wait_for(before + sequences))[before:]
        for word in WORDS:
            for arrival in arrivals:
                front.gpu.emit(arrival.record.request_id, ids(vocab, word))
            await next_event(resp)
        for arrival in arrivals:
            front.gpu.finish(arrival.record.request_id, finish=FinishReason.LENGTH)
        await events(resp)
    assert taken == []


async def test_any_mix_of_the_two_ways_delivers_the_text_whole_and_in_order(
        make_frontend: Factory, vocab: Vocabulary, taken: list[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Records of 1-3 ids (characters split over records included), 1-4 records a
    poll, the connection ready or not at random: the client gets the full decode of
    the ids, in order, each time (40 seeded trials)."""
    rng = random.Random(1207)
    monkeypatch.setattr(_DirectWriter, "ready", lambda self: rng.random() < 0.7)
    text = "Hello wörld, 中文 and 🙂🙂 again: ünïcödé, done."
    generated = ids(vocab, text)
    assert vocab.decode(list(generated)) == text
    front = await make_frontend()
    events_seen = 0
    for trial in range(40):
        resp = await front.client.post("/v1/completions", json=COMPLETION)
        (arrival, *_) = (await front.gpu.wait_for(trial + 1))[trial:]
        request_id = arrival.record.request_id
        reading = asyncio.create_task(events(resp))
        left = list(generated)
        while left:
            for _ in range(rng.randint(1, 4)):  # the records of one poll
                take = rng.randint(1, 3)
                record, left = tuple(left[:take]), left[take:]
                if record:
                    front.gpu.emit(request_id, record)
            await front.gpu.wait_exchanges(2)
        front.gpu.finish(request_id, finish=FinishReason.LENGTH)
        got = await reading
        assert "".join(text_of(e) for e in got) == text, f"trial {trial}"
        assert got[-1]["choices"][0]["finish_reason"] == "length"
        events_seen += len(got)
    assert 0 < len(taken) < events_seen  # both ways were taken
