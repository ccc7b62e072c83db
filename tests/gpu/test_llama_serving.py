"""Llama-architecture models behind the daemon (issue 25), over the shm transport, with
the official openai SDK in front, each peer run with ``--scheduler host`` and with
``--scheduler gpu``:

- SmolLM2-135M-Instruct from its GGUF file (``--weights``) and the tokenizer setup built
  from the same file (``--tokenizer``) answers questions; streamed and unstreamed
  answers are one text, and it is what transformers' ``LlamaForCausalLM``, loaded from
  the file itself (``gguf_file=``), generates greedily;
- the small random Llama and Phi-3 of test_llama serve what the engine generates.

Each test prints what it measured (docs/gpu.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from openai import OpenAI

from dpu_frontend.model.config import ModelConfig
from dpu_frontend.text.chat_template import ChatTemplate
from dpu_frontend.text.tokenizer import Vocabulary
from tests.assets import smollm2_gguf, smollm2_tokenizer
from tests.constraint_cases import (
    ORDER,
    PERSON,
    constrained_chat,
    satisfies_order,
    satisfies_person,
)
from tests.gpu.test_llama import (
    QUESTIONS,
    SMALL_LLAMA,
    SMALL_MOE,
    SMALL_PHI3,
    greedy_transformers,
)
from tests.gpu.test_model import SEED, TIE_MARGIN, engine, greedy
from tests.stack import MODEL, Stack, running_stack

pytestmark = pytest.mark.gpu

SCHEDULERS = ("host", "gpu")
#: Room for the test's questions; the answers end at the template's <|im_end|>.
ANSWER_TOKENS = 48
PEER_ARGS = ("--max-seqs", "16", "--max-model-len", "2048", "--kv-blocks", "256")


def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.load(smollm2_tokenizer())


@pytest.fixture(scope="module", params=SCHEDULERS)
def smollm2_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    peer = (*PEER_ARGS, "--weights", str(smollm2_gguf()), "--dtype", "float32",
            "--tokenizer", str(smollm2_tokenizer()), "--scheduler", request.param)
    with running_stack("shm", timeout=600, peer_command="model-peer", peer_args=peer,
                       serve_args=("--tokenizer", str(smollm2_tokenizer()))) as stack:
        stack.extra["scheduler"] = request.param
        yield stack


#: What the model is asked to answer in, as an application would ask it.
CITY_SCHEMA = {"type": "object",
               "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city", "country"], "additionalProperties": False}


def test_smollm2_answers_within_a_json_schema(smollm2_stack: Stack) -> None:
    """A real model's answer held to JSON schemas by the automata walked on the GPU
    (either scheduler): valid JSON that satisfies its schema, streamed as unstreamed."""
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": CITY_SCHEMA,
                                                    "strict": True}}
    kw: Any = {"model": MODEL, "max_tokens": ANSWER_TOKENS, "temperature": 0.0,
               "response_format": fmt,
               "messages": [{"role": "user", "content": "What is the capital of France? Answer "
                                                        "in JSON with the keys city and country."}]}
    with client(smollm2_stack) as c:
        text = constrained_chat(c, kw)
    answer = json.loads(text)
    assert set(answer) == {"city", "country"} and all(isinstance(v, str) for v in answer.values())
    print(f"SmolLM2 within a JSON schema ({smollm2_stack.extra['scheduler']} scheduler): "
          f"{text!r}")
    with client(smollm2_stack) as c:
        for name, schema, satisfies in (("person", PERSON, satisfies_person),
                                        ("order", ORDER, satisfies_order)):
            kw["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": name, "schema": schema}}
            kw["messages"] = [{"role": "user", "content": f"Make up a {name}, as JSON."}]
            kw["max_tokens"] = 400
            text = constrained_chat(c, kw)
            assert satisfies(json.loads(text)), text
            print(f"SmolLM2, {name} schema: {text!r}")


def test_smollm2_answers_through_the_daemon(smollm2_stack: Stack, smollm2_reference: Any,
                                            vocab: Vocabulary) -> None:
    assert vocab.chat_template is not None
    template = ChatTemplate(vocab.chat_template, vocab.special_tokens, "smollm2")
    (eos,) = vocab.eos_token_ids
    answers = []
    with client(smollm2_stack) as c:
        for question in QUESTIONS[:4]:
            messages: Any = [{"role": "user", "content": question}]
            full = c.chat.completions.create(model=MODEL, messages=messages,
                                             max_tokens=ANSWER_TOKENS, temperature=0.0)
            chunks = list(c.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                    max_tokens=ANSWER_TOKENS, temperature=0.0))
            text = full.choices[0].message.content or ""
            streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            assert streamed == text, (question, streamed, text)
            assert len([ch for ch in chunks if ch.choices and ch.choices[0].delta.content]) > 1
            prompt = vocab.encode(template.render(messages))
            assert full.usage is not None and full.usage.prompt_tokens == len(prompt)
            theirs, margins = greedy_transformers(smollm2_reference, prompt, ANSWER_TOKENS,
                                                  eos)
            margin = min(margins)
            expected = vocab.decode(theirs)
            # A divergence is excused only by a float32 tie on transformers' side.
            assert text == expected or margin < TIE_MARGIN, (question, text, expected, margin)
            if text == expected:
                ended = "length" if len(theirs) == ANSWER_TOKENS else "stop"
                assert full.choices[0].finish_reason == ended, (question, text)
            print(f"{question!r} -> {text!r}" + ("" if text == expected else
                                                 f" (transformers: {expected!r}, tie {margin:.3g})"))
            answers.append(text)
    assert "Paris" in answers[0] and "5" in answers[1]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("config_dict", [SMALL_LLAMA, SMALL_PHI3, SMALL_MOE],
                         ids=["llama", "phi3", "qwen3_moe"])
def test_a_small_random_model_through_the_daemon(config_dict: dict[str, Any], scheduler: str,
                                                 vocab: Vocabulary, tmp_path: Path) -> None:
    """Greedy completions through the daemon are the engine's own tokens for the same
    weights (batch-invariant kernels: the peer's batch is not the test's)."""
    config_file = tmp_path / "config.json"
    config_file.write_text(json.dumps(config_dict))
    config = ModelConfig.from_dict(config_dict, "small")
    offline = engine("bfloat16", num_blocks=256, config=config, max_seqs=8, max_model_len=2048)
    texts = ["The ring buffer in GPU memory", "Once upon a time", "def main():"]
    expected = [vocab.decode(r.tokens) for r in offline.generate(
        [vocab.encode(t) for t in texts], [greedy(24)] * len(texts))]
    del offline
    torch.cuda.empty_cache()
    peer = (*PEER_ARGS, "--model-config", str(config_file), "--weight-seed", str(SEED),
            "--tokenizer", str(smollm2_tokenizer()), "--scheduler", scheduler)
    with running_stack("shm", timeout=600, peer_command="model-peer", peer_args=peer,
                       serve_args=("--tokenizer", str(smollm2_tokenizer()))) as stack, \
            client(stack) as c:
        for text, want in zip(texts, expected, strict=True):
            got = c.completions.create(model=MODEL, prompt=text, max_tokens=24, temperature=0.0,
                                       extra_body={"ignore_eos": True})
            assert got.choices[0].text == want, (text, got.choices[0].text, want)
    print(f"small random {config.architecture}, bf16, --scheduler {scheduler}: {len(texts)} "
          "greedy completions through the daemon = the engine's tokens")
