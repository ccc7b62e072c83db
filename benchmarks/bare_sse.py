"""The bare limit of the streaming benchmarks: aiohttp streaming canned SSE events.

Same framework, same event shape and count as the daemon's answer, but no
ring, no peer: what is left is aiohttp's own cost per event. With
``--tokenizer DIR`` each event is also what the daemon's pipeline must do at
the least for a token: one ``DecodeStream.step`` of the next id of the
reference peer's corpus, and the chunk filled in around the text's JSON (the
issue's "bare pipeline": detokenize, JSON chunk, aiohttp write).

    python -m benchmarks.bare_sse --port 0 --events 256
    python -m benchmarks.bare_sse --port 0 --events 256 --tokenizer DIR --step-ms 20

``--step-ms`` paces it as the reference peer's decode steps pace the daemon: every
step, one event a stream (a wake-up and a write each, as the daemon's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable, Iterator
from json.encoder import encode_basestring
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from dpu_frontend.peer.generator import default_corpus

Texts = Callable[[], Iterator[str]]


def canned() -> Iterator[str]:
    while True:
        yield " word"


def corpus_ids(tokenizer: Tokenizer) -> list[int]:
    """The reference peer's corpus as ids: what its replay generates."""
    return [i for doc in default_corpus() for i in tokenizer.encode(doc).ids]


def detokenized(tokenizer: Tokenizer) -> Texts:
    """Each stream's texts: the corpus's ids, one ``DecodeStream.step`` an event."""
    ids = corpus_ids(tokenizer)

    def texts() -> Iterator[str]:
        stream = DecodeStream(skip_special_tokens=True)
        k = 0
        while True:
            yield stream.step(tokenizer, ids[k % len(ids)]) or ""
            k += 1

    return texts


class Steps:
    """A decode step every ``period`` seconds, as the reference peer's ``--step-ms``: each
    stream writes one event a step, the load shape the daemon carries."""

    def __init__(self, period: float) -> None:
        self.period = period
        self._next: asyncio.Future[None] | None = None

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.period)
            if self._next is not None:
                self._next.set_result(None)
            self._next = loop.create_future()

    async def wait(self) -> None:
        if self.period <= 0:
            return
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        await self._next


def build(events: int, texts: Texts = canned, steps: Steps | None = None) -> web.Application:
    pace = steps or Steps(0.0)

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        count = min(int(body.get("max_tokens", events)), events)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        created = int(time.time())
        def event(text: str, finish: str | None) -> dict[str, Any]:
            return {"id": "cmpl-bare", "object": "text_completion", "created": created,
                    "model": "bare", "choices": [{"index": 0, "text": text, "logprobs": None,
                                                  "finish_reason": finish}]}

        before, _, after = ("data: " + json.dumps(event("\x00", None)) + "\n\n").partition(
            '"\\u0000"')
        head, tail = before.encode(), after.encode()
        stream = texts()
        for _ in range(count - 1):
            await pace.wait()
            if text := next(stream):
                await response.write(head + encode_basestring(text).encode() + tail)
        await response.write(b"data: " + json.dumps(event(next(stream), "length")).encode()
                             + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-bare", "object": "text_completion", "created": created,
                     "model": "bare", "choices": [],
                     "usage": {"prompt_tokens": 1, "completion_tokens": count,
                               "total_tokens": count + 1}}
            await response.write(b"data: " + json.dumps(usage).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    return app


async def serve(port: int, events: int, texts: Texts, step_s: float) -> None:
    steps = Steps(step_s)
    runner = web.AppRunner(build(events, texts, steps), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"daemon listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    # Until the benchmark terminates this process.
    await (steps.run() if step_s > 0 else asyncio.Event().wait())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--events", type=int, default=256)
    parser.add_argument("--tokenizer", type=Path, help="detokenize each event's token")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="one event a stream every step (0: as fast as it goes)")
    args = parser.parse_args()
    texts = (detokenized(Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")))
             if args.tokenizer else canned)
    uvloop.run(serve(args.port, args.events, texts, args.step_ms / 1e3))


if __name__ == "__main__":
    main()
