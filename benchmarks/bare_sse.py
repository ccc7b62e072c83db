"""The bare limit for the end-to-end benchmark: aiohttp streaming canned SSE events.

Same framework, same event shape and count as the daemon's answer, but no
tokenizer, no ring, no peer: what is left is aiohttp's own cost per event.

    python -m benchmarks.bare_sse --port 0 --events 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvloop
from aiohttp import web


def build(events: int) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        count = min(int(body.get("max_tokens", events)), events)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        created = int(time.time())
        for i in range(count):
            chunk = {"id": "cmpl-bare", "object": "text_completion", "created": created,
                     "model": "bare", "choices": [{"index": 0, "text": " word", "logprobs": None,
                                                   "finish_reason": "length" if i == count - 1
                                                   else None}]}
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
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


async def serve(port: int, events: int) -> None:
    runner = web.AppRunner(build(events), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    print(f"daemon listening on http://127.0.0.1:{runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()  # until the benchmark terminates this process


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--events", type=int, default=256)
    args = parser.parse_args()
    uvloop.run(serve(args.port, args.events))


if __name__ == "__main__":
    main()
