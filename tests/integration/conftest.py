"""The process-level stacks every integration module shares.

``stack`` is one daemon and one replay peer over shm, started once for the
whole run: every module that only sends requests to it uses it. A module
that needs its own shape (a metrics module that counts exactly, a small
stream buffer) sets ``STACK = {...}`` (``running_stack`` arguments) and asks
for ``own_stack``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from openai import OpenAI

from dpu_frontend.text.tokenizer import Vocabulary
from tests.integration.scenarios import load_vocab
from tests.stack import Stack, running_stack


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    with running_stack("shm", timeout=60) as s:
        yield s


@pytest.fixture(scope="module")
def own_stack(request: pytest.FixtureRequest) -> Iterator[Stack]:
    arguments = getattr(request.module, "STACK", {})
    with running_stack("shm", timeout=60, **arguments) as s:
        yield s


@pytest.fixture(scope="session")
def vocab() -> Vocabulary:
    """The bundled tokenizer, as the shared stack's daemon and peer load it."""
    return load_vocab()


@pytest.fixture
def client(stack: Stack) -> Iterator[OpenAI]:
    """The official SDK, synchronous, on the shared stack."""
    c = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0)
    yield c
    c.close()
