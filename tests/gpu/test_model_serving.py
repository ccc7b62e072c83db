"""The model engine behind the daemon: ``model-peer`` on the GPU, host-scheduled with its
records written by the GPU or by the host, or scheduled inside the GPU (``--scheduler
gpu``); the daemon over the shm transport, the official openai SDK in front
(docs/gpu.md). Every test runs against the three."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from openai import OpenAI

from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.ring.records import SamplingParams
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.tokenizer import Vocabulary
from tests.constraint_cases import (
    ORDER,
    PERSON,
    constrained_chat,
    satisfies_order,
    satisfies_person,
)
from tests.stack import MODEL, Stack, running_stack

pytestmark = pytest.mark.gpu

SEED = 20261126
#: A small KV cache: the test process loads its own copy of the model beside the peer.
MODEL_ARGS = ("--max-seqs", "64", "--max-model-len", "2048", "--kv-blocks", "512",
              "--weight-seed", str(SEED))
PROMPT = "The ring buffer in GPU memory"


#: The peers: host loop with the GPU's record writer (the default) and with the host's
#: (the baseline), and the scheduler inside the GPU.
PEERS = {"gpu": ("--records", "gpu"), "host": ("--records", "host"),
         "gpu-scheduler": ("--scheduler", "gpu")}


@pytest.fixture(scope="module", params=list(PEERS))
def model_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    with running_stack("shm", timeout=600, peer_command="model-peer",
                       peer_args=(*MODEL_ARGS, *PEERS[request.param])) as stack:
        stack.extra["peer"] = request.param
        yield stack


#: The host-driven engine's sizes (conftest's ``offline``, on the same weights).
OFFLINE = {"num_blocks": 256, "max_seqs": 8, "max_model_len": 2048}


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


def test_a_seeded_stream_equals_the_full_answer(model_stack: Stack) -> None:
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0.8, "top_p": 0.95,
          "seed": 11}
    with client(model_stack) as c:
        full = c.completions.create(**kw)  # type: ignore[call-overload]
        pieces, finishes = [], []
        for chunk in c.completions.create(stream=True, **kw):  # type: ignore[call-overload]
            pieces.append(chunk.choices[0].text)
            finishes.append(chunk.choices[0].finish_reason)
    text = full.choices[0].text
    assert text and "".join(pieces) == text
    assert finishes[-1] == full.choices[0].finish_reason
    assert len([p for p in pieces if p]) > 1, "not streamed"
    print(f"seeded completion through the daemon, streamed = full: {text[:60]!r}...")


def test_the_daemon_serves_what_the_engine_generates(model_stack: Stack,
                                                     offline: ModelEngine) -> None:
    vocab = Vocabulary.load(default_tokenizer_dir())
    ids = vocab.encode(PROMPT)
    # Greedy, and each sampler stage alone (the GPU scheduler's variants: plain,
    # top-k, top-p, min-p, penalties).
    cases = [SamplingParams(max_tokens=24, temperature=0.0),
             SamplingParams(max_tokens=24, temperature=0.9, seed=4),
             SamplingParams(max_tokens=24, temperature=1.0, top_k=50, seed=5),
             SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=6),
             SamplingParams(max_tokens=24, temperature=1.2, min_p=0.05, seed=7),
             SamplingParams(max_tokens=24, temperature=0.7, presence_penalty=0.5,
                            frequency_penalty=0.3, repetition_penalty=1.2, seed=8),
             SamplingParams(max_tokens=24, temperature=0.0, repetition_penalty=1.5)]
    with client(model_stack) as c:
        for params in cases:
            expected = offline.generate([ids], [params])[0]
            got = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=params.max_tokens,
                                       temperature=params.temperature, seed=params.seed,
                                       top_p=params.top_p, presence_penalty=params.presence_penalty,
                                       frequency_penalty=params.frequency_penalty,
                                       extra_body={"top_k": params.top_k, "min_p": params.min_p,
                                                   "repetition_penalty": params.repetition_penalty})
            assert got.choices[0].text == vocab.decode(expected.tokens)
            assert got.usage is not None and got.usage.completion_tokens == len(expected.tokens)
    print(f"{len(cases)} greedy and seeded completions (every sampler stage) through the daemon "
          "equal the host engine's own tokens")


def test_chat_stream_with_the_sdk(model_stack: Stack) -> None:
    with client(model_stack) as c:
        chunks = list(c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say something."}],
            max_tokens=16, stream=True, seed=3, temperature=0.7))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1]
    assert finish in ("length", "stop")
    assert text or finish == "stop"
    print(f"chat stream through the daemon: {len(chunks)} chunks, finish {finish}")


def test_logprobs_through_the_daemon_are_the_engines(model_stack: Stack,
                                                     offline: ModelEngine) -> None:
    """Chat ``logprobs``/``top_logprobs`` and completions ``logprobs``, streamed and not,
    carry the engine's own values (bit for bit: batch-invariant kernels)."""
    vocab = Vocabulary.load(default_tokenizer_dir())
    ids = vocab.encode(PROMPT)
    expected = offline.generate([ids], [SamplingParams(max_tokens=12, temperature=0.0,
                                                       logprobs=5)])[0]
    assert len(expected.logprobs) == len(expected.tokens) and len(expected.top[0]) == 5
    with client(model_stack) as c:
        full = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0,
                                    logprobs=5)
        chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                           temperature=0.0, logprobs=5, stream=True))
        chat = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0.0,
                                         messages=[{"role": "user", "content": "Hi"}],
                                         logprobs=True, top_logprobs=3)
    lp = full.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs == pytest.approx(expected.logprobs, abs=1e-6)
    for theirs, ours in zip(lp.top_logprobs, expected.top, strict=True):
        # Keyed by token text, so two ids of one text share an entry.
        assert theirs and all(any(abs(v - o) < 1e-6 for _, o in ours) for v in theirs.values())
    streamed = [x for ch in chunks if ch.choices and ch.choices[0].logprobs
                for x in ch.choices[0].logprobs.token_logprobs or ()]
    assert streamed == lp.token_logprobs
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].logprob  # the most likely first
    print(f"log probabilities through the daemon = the engine's: {len(expected.tokens)} tokens "
          f"x 5 alternatives; first {expected.logprobs[0]:.4f}")


#: A JSON schema whose answers all end within a few tokens (so a random model ends it
#: with STOP): an object of one property, one of two values.
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
                 "required": ["answer"], "additionalProperties": False}


def test_structured_output_through_the_daemon(model_stack: Stack) -> None:
    """``response_format`` json_schema (chat) and ``guided_regex`` (completions), streamed
    and not: the sampler walks the automata on the GPU (with the GPU scheduler, its
    constrained sampler graphs), so even random weights answer within them."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA,
                                                    "strict": True}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Is the ring full?"}],
            "max_tokens": 40, "temperature": 0.9, "seed": 5, "response_format": fmt}
    regex = {"model": MODEL, "prompt": PROMPT, "max_tokens": 20, "temperature": 0.0,
             "extra_body": {"guided_regex": "[0-9]{3}-[a-z]{2}"}}
    with client(model_stack) as c:
        content = constrained_chat(c, chat)
        code = c.completions.create(**regex)  # type: ignore[call-overload]
    assert json.loads(content) in ({"answer": "yes"}, {"answer": "no"}), content
    assert code.choices[0].finish_reason == "stop"
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", code.choices[0].text), code.choices[0].text
    print(f"structured output through the daemon, walked on the GPU: {content!r} (json_schema, "
          f"streamed the same), {code.choices[0].text!r} (guided_regex)")


@pytest.mark.parametrize("name", ["person", "order"])
def test_schemas_of_increasing_difficulty_through_the_daemon(model_stack: Stack,
                                                             name: str) -> None:
    """The structured-output tests' schemas (an enum, bounded strings and arrays; nested
    objects, a pattern, anyOf with null: automata of 13 and 30 MB): with random weights,
    every answer ends, parses and satisfies its schema, streamed as unstreamed."""
    schema, satisfies = {"person": (PERSON, satisfies_person),
                         "order": (ORDER, satisfies_order)}[name]
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    with client(model_stack) as c:
        for seed in (1, 2):
            kw: Any = {"model": MODEL, "max_tokens": 600, "temperature": 0.8, "seed": seed,
                       "response_format": fmt,
                       "messages": [{"role": "user", "content": f"A {name}, as JSON."}]}
            text = constrained_chat(c, kw)
            assert satisfies(json.loads(text)), text
            print(f"{name}, seed {seed}: {text!r}")


def test_many_streams_and_disconnects_end_cleanly(model_stack: Stack) -> None:
    """48 concurrent streams, 8 of them dropped by their client after two chunks: every
    other one ends with its finish reason and its tokens, and the peer takes the next
    request at once (the dropped ones were cancelled, nothing is stuck)."""
    def one(i: int) -> tuple[str | None, int]:
        with client(model_stack) as c:
            stream = c.completions.create(model=MODEL, prompt=f"{PROMPT} {i}", max_tokens=48,
                                          temperature=1.0, seed=i, stream=True,
                                          stream_options={"include_usage": True})
            finish, tokens = None, 0
            for n, chunk in enumerate(stream):
                if i % 6 == 5 and n == 2:
                    stream.close()  # the client goes away mid-stream
                    return "dropped", 0
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return finish, tokens

    with ThreadPoolExecutor(48) as pool:
        results = list(pool.map(one, range(48)))
    dropped = [r for r in results if r[0] == "dropped"]
    done = [r for r in results if r[0] != "dropped"]
    assert len(dropped) == 8
    assert all(finish in ("length", "stop") and tokens <= 48 for finish, tokens in done)
    assert any(finish == "length" and tokens == 48 for finish, tokens in done)
    with client(model_stack) as c:
        after = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0.0)
    assert after.choices[0].finish_reason in ("length", "stop")
    print(f"48 concurrent streams, 8 dropped: {sum(t for _, t in done)} tokens delivered")
