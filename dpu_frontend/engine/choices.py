"""Several sequences of one request (prompts x n), merged into one stream of choice deltas.

Choice ``i * n + j`` is the ``j``-th sequence of prompt ``i`` (OpenAI's order).
All are submitted at once (``start_choices``), so that an admission error is
the request's status, not an event after a 200. Each then runs as its own
task; the merged stream ends when every choice has finished, and leaving it
early (a client that went away) cancels them all, which cancels their
generation on the GPU side.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncGenerator

from dpu_frontend.engine.service import Delta, DeltaSink, Generation, Service, TextOptions
from dpu_frontend.ring import SamplingParams
from dpu_frontend.ring.automaton import Constraint

MERGE_QUEUE_PER_CHOICE = 8


class Choices:
    """The submitted sequences of one request."""

    def __init__(self, generations: list[Generation]) -> None:
        self.generations = generations

    def batches(self) -> AsyncGenerator[list[Delta], None]:
        """The deltas, as many at a time as have come: a single sequence's, all its
        records of one poll (the common case: no task, no queue); several sequences'
        merged, one at a time."""
        if len(self.generations) == 1:
            return self.generations[0].batches()
        return _one_at_a_time(_merged(self.generations))

    def attach(self, sink: DeltaSink) -> bool:
        """A single sequence's deltas to ``sink`` from the poll loop (``Generation.attach``);
        False with several (their deltas are merged by tasks) or where that one cannot."""
        return len(self.generations) == 1 and self.generations[0].attach(sink)

    def cancel(self) -> None:
        """Stop every sequence still generating (a no-op for those that ended). Needed
        even if ``deltas`` never started: an unstarted generator has no cleanup to run."""
        for generation in self.generations:
            generation.cancel()


def start_choices(service: Service, prompts: list[list[int]], params: SamplingParams, n: int,
                  options: TextOptions, constraint: Constraint | None = None) -> Choices:
    """Submit every choice now, raising admission errors before any response byte; each
    is decoded within ``constraint`` where there is one."""
    choices = Choices([])
    try:
        for i, prompt in enumerate(prompts):
            for j in range(n):
                choices.generations.append(service.submit(prompt, _nth(params, j), options,
                                                          i * n + j, constraint))
    except BaseException:
        choices.cancel()
        raise
    return choices


async def _one_at_a_time(deltas: AsyncGenerator[Delta, None]) -> AsyncGenerator[list[Delta], None]:
    async with contextlib.aclosing(deltas):
        async for delta in deltas:
            yield [delta]


async def _merged(generations: list[Generation]) -> AsyncGenerator[Delta, None]:
    # Bounded: a slow reader stalls the choice tasks, so records pile up in each
    # request's own bounded stream buffer (which cuts a too-slow client off),
    # never here.
    queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue(
        maxsize=MERGE_QUEUE_PER_CHOICE * len(generations))

    async def run(generation: Generation) -> None:
        try:
            async with contextlib.aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    await queue.put(delta)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(run(g)) for g in generations]
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
