"""Several sequences of one request (prompts x n), merged into one stream of choice deltas.

Choice ``i * n + j`` is the ``j``-th sequence of prompt ``i`` (OpenAI's order).
Each runs as its own task; the merged stream ends when every choice has
finished, and leaving it early (a client that went away) cancels them all,
which cancels their generation on the GPU side.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from dpu_frontend.engine.service import Service, TextOptions
from dpu_frontend.ring import SamplingParams


@dataclass(frozen=True, slots=True)
class ChoiceDelta:
    index: int
    text: str
    finish_reason: str | None
    completion_tokens: int  # of this choice so far


async def generate_choices(service: Service, prompts: list[list[int]], params: SamplingParams,
                           n: int, options: TextOptions) -> AsyncGenerator[ChoiceDelta, None]:
    jobs = [(i * n + j, prompt, _nth(params, j)) for i, prompt in enumerate(prompts)
            for j in range(n)]
    if len(jobs) == 1:  # the common case: no task, no queue
        async with contextlib.aclosing(service.generate(prompts[0], params, options)) as deltas:
            async for d in deltas:
                yield ChoiceDelta(0, d.text, d.finish_reason, d.completion_tokens)
        return
    queue: asyncio.Queue[ChoiceDelta | BaseException] = asyncio.Queue()

    async def run(index: int, prompt: list[int], choice_params: SamplingParams) -> None:
        try:
            async with contextlib.aclosing(service.generate(prompt, choice_params, options)) as g:
                async for d in g:
                    queue.put_nowait(ChoiceDelta(index, d.text, d.finish_reason,
                                                 d.completion_tokens))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(run(*job)) for job in jobs]
    try:
        pending = len(tasks)
        while pending:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None:
                pending -= 1
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _nth(params: SamplingParams, j: int) -> SamplingParams:
    """Choice ``j`` of n: a seeded request gets seed + j, so that the choices differ."""
    if j == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % 2**64)
