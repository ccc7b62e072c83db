"""Test bodies shared by the shm (native) and verbs (soft-RoCE) integration tests."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from collections.abc import Sequence

import aiohttp
from openai import AsyncOpenAI, OpenAI
from openai.types.chat import ChatCompletionMessageParam

from dpu_frontend.peer.generator import TokenGenerator, default_corpus
from dpu_frontend.ring import FinishReason, GenerateRecord, SamplingParams
from dpu_frontend.ring.automaton import CheckedAutomaton
from dpu_frontend.ring.layout import Geometry
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.chat_template import load_chat_template
from dpu_frontend.text.constraints import ConstraintCompiler, ConstraintSpec
from dpu_frontend.text.tokenizer import Vocabulary
from tests.stack import MODEL, Stack

PROMPT = "Tell me about the request ring."


def peer_generation(vocab: Vocabulary, prompt: str, max_tokens: int) -> tuple[list[int], str]:
    """The ids the reference peer generates for ``prompt`` (its engine is deterministic)."""
    return replay_generation(vocab, vocab.encode(prompt), max_tokens)


def load_vocab() -> Vocabulary:
    return Vocabulary.load(default_tokenizer_dir())


async def raw_sse(stack: Stack, body: dict[str, object]) -> list[str]:
    """The ``data:`` payloads of a streamed response, read straight off the socket."""
    async with aiohttp.ClientSession() as session, session.post(
            f"{stack.base_url}/v1/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        events = []
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line:
                assert line.startswith("data: "), line
                events.append(line[len("data: "):])
        return events


async def check_stream_equals_full_and_decode(stack: Stack) -> None:
    vocab = load_vocab()
    max_tokens = 60
    ids, finish = peer_generation(vocab, PROMPT, max_tokens)
    expected = vocab.decode(ids)
    assert expected.strip()

    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    try:
        full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens)
        streamed = []
        finishes = []
        for chunk in client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=max_tokens,
                                               stream=True):
            streamed.append(chunk.choices[0].text)
            finishes.append(chunk.choices[0].finish_reason)
    finally:
        client.close()
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == finish
    assert full.usage is not None
    assert full.usage.completion_tokens == len(ids)
    assert full.usage.prompt_tokens == len(vocab.encode(PROMPT))
    assert "".join(streamed) == expected
    assert len([s for s in streamed if s]) > 1, "the text arrived in one piece: not streamed"
    assert finishes[-1] == finish and all(f is None for f in finishes[:-1])

    events = await raw_sse(stack, {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                                   "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected


async def check_peer_killed_mid_stream(stack: Stack, max_tokens: int = 5000) -> None:
    """kill -9 the peer: the open stream ends with an error event and [DONE], promptly;
    a request waiting for its answer gets a 503; nothing hangs. ``max_tokens``: long
    enough that the peer cannot finish both before the kill (an unpaced CUDA peer
    generated 5,000 tokens in 70 ms)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        full = asyncio.create_task(session.post(f"{stack.base_url}/v1/completions", json=body))
        async with session.post(f"{stack.base_url}/v1/completions",
                                json=body | {"stream": True}) as resp:
            assert resp.status == 200
            events: list[str] = []
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line:
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    stack.peer.send_signal(signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert set(error) == {"error"} and error["error"]["code"] == 503, error
        assert all("choices" in json.loads(e) for e in events[:-2])
        async with await full as answer:
            assert answer.status == 503
            assert (await answer.json())["error"]["type"] == "service_unavailable"


CHAT: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is a request ring? 🚀"}]


def chat_prompt_ids(vocab: Vocabulary) -> list[int]:
    """The prompt the daemon must send for CHAT: the template rendered, tokenized as HF does."""
    template = load_chat_template(vocab, None)
    assert template is not None
    return vocab.encode(template.render([dict(m) for m in CHAT], add_generation_prompt=True),
                        add_special_tokens=False)


def replay_answers(vocab: Vocabulary, prompts: Sequence[Sequence[int]],
                   params: Sequence[SamplingParams],
                   automaton: CheckedAutomaton | None = None) -> list[tuple[list[int], FinishReason]]:
    """Each request's ids and finish as the reference peer's replay gives them (its
    engine is deterministic), walking ``automaton`` where one constrains them."""
    per_record = Geometry().plan(1).channels[0].tokens_per_response
    engine = TokenGenerator(mode="replay", corpus_ids=[vocab.encode(d) for d in default_corpus()],
                    eos_token_ids=vocab.eos_token_ids, tokens_per_s=0, tokens_per_step=per_record)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.admit(GenerateRecord(i + 1, 0, 0, p), tuple(prompt), time.monotonic(), automaton)
    out: dict[int, tuple[list[int], FinishReason]] = {i + 1: ([], FinishReason.NONE)
                                                      for i in range(len(prompts))}
    while any(finish is FinishReason.NONE for _, finish in out.values()):
        for record in engine.step(time.monotonic(), 64):
            ids, _ = out[record.request_id]
            out[record.request_id] = (ids + list(record.tokens), record.finish)
    return list(out.values())


def replay_generation(vocab: Vocabulary, prompt_ids: list[int], max_tokens: int,
                      seed: int | None = None,
                      automaton: CheckedAutomaton | None = None) -> tuple[list[int], str]:
    """The ids the reference peer generates for these prompt ids, and its finish."""
    [(ids, finish)] = replay_answers(vocab, [prompt_ids],
                                     [SamplingParams(max_tokens=max_tokens, seed=seed)], automaton)
    return ids, {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}[finish]


async def check_chat_stream_sdk(stack: Stack) -> None:
    """Chat through the async SDK, streamed: role first, then content equal to the full decode."""
    vocab = load_vocab()
    ids, finish = replay_generation(vocab, chat_prompt_ids(vocab), 40)
    expected = vocab.decode(ids)
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=40, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        full = await client.chat.completions.create(model=MODEL, messages=CHAT,
                                                    max_tokens=40)
    finally:
        await client.close()
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and not first.content
    content = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(content) == expected == full.choices[0].message.content
    assert len([c for c in content if c]) > 1
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == finish == full.choices[0].finish_reason
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids)
    assert full.usage is not None
    assert full.usage.prompt_tokens == len(chat_prompt_ids(vocab))


#: A regex whose automaton is a few MB over the bundled vocabulary (3.2 MB: 31 dense
#: states), fast to compile: the ring carries it in one WRITE of the arena.
WORD_REGEX = "[a-z]{1,30}"
#: A capitalized word and three more (594 KB): the replay's own words where it allows
#: them, else the walk's shortest ones (the corpus has "Streaming text is harder", and
#: "RoCE" where a lowercase word must come), so a walk takes both kinds of token.
SENTENCE_REGEX = "[A-Z][a-z]+( [a-z]+){3}"


async def check_constrained_sdk(stack: Stack, regex: str = WORD_REGEX) -> str:
    """A constrained chat answer through the async SDK, streamed and not: the automaton
    compiled in the daemon, carried after the prompt in the arena, walked by the peer;
    the answer matches the regex, and both are one text (returned)."""
    client = AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=600)
    try:
        full = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=40, extra_body={"guided_regex": regex})
        stream = await client.chat.completions.create(
            model=MODEL, messages=CHAT, max_tokens=40, stream=True,
            extra_body={"guided_regex": regex})
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices])
    finally:
        await client.close()
    text = full.choices[0].message.content or ""
    assert re.fullmatch(regex, text) and streamed == text, (text, streamed)
    assert full.choices[0].finish_reason == "stop"
    return text


async def check_constrained_equals_the_reference(stack: Stack) -> None:
    """check_constrained_sdk's answer, for SENTENCE_REGEX, is the reference peer's walk
    of the same automaton (``AutomatonWalk``), compiled here as the daemon compiles it:
    what every peer's replay must give, the CUDA peer's too."""
    vocab = load_vocab()
    compiler = ConstraintCompiler(vocab.tokenizer, vocab.eos_token_ids[0])
    automaton = CheckedAutomaton.of(compiler.compile(ConstraintSpec.regex(SENTENCE_REGEX)))
    ids, finish = replay_generation(vocab, chat_prompt_ids(vocab), 40, automaton=automaton)
    assert finish == "stop"
    assert await check_constrained_sdk(stack, SENTENCE_REGEX) == vocab.decode(ids)
