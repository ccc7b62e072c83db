"""A streamed event of plain text is filled into a template rendered once per choice
(``GenerationHandler._template``): its bytes must be exactly those of the whole chunk
rendered as JSON, for any text and either endpoint."""

from __future__ import annotations

from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dpu_frontend.engine.service import Delta, Service
from dpu_frontend.http.chat import ChatCompletionsHandler
from dpu_frontend.http.completions import CompletionsHandler
from dpu_frontend.http.generation import GenerationHandler, Job, _event, _json_string

HANDLERS = [CompletionsHandler, ChatCompletionsHandler]
USAGE: list[dict[str, Any]] = [{}, {"usage": None}]


def job() -> Job:
    return Job("cmpl-0123", 1795762698, 'the "model" \\ ü', [[1, 2]], 2, False)


@pytest.mark.parametrize("usage", USAGE)
@pytest.mark.parametrize("handler_type", HANDLERS)
@given(text=st.text(min_size=1), index=st.integers(0, 3))
def test_a_filled_template_is_the_whole_chunk(handler_type: type[GenerationHandler[Any]],
                                              usage: dict[str, Any], text: str,
                                              index: int) -> None:
    handler = handler_type(cast(Service, None), "m")
    j = job()
    before, after = handler._template(j, index, usage)
    delta = Delta(index, text, None, 1)
    assert before + _json_string(text) + after == _event(handler.chunk(j, delta) | usage)


def test_a_chunk_without_the_text_has_no_template() -> None:
    class Broken(CompletionsHandler):
        def chunk(self, job: Job, delta: Delta) -> dict[str, Any]:
            return {"text": "constant"}

    with pytest.raises(RuntimeError, match="must hold the text once"):
        Broken(cast(Service, None), "m")._template(job(), 0, {})
