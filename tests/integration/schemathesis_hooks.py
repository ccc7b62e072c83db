"""Schemathesis hooks of ``test_schemathesis`` (loaded through SCHEMATHESIS_HOOKS).

Whether a JSON schema or a regular expression compiles into a token automaton, and in
how long, is something no OpenAPI document can state: a schema-valid ``guided_json``,
``response_format`` ``json_schema``, ``guided_regex`` or forced tool call
(``tool_choice`` required or named: the tools' parameters compile, and a named one must
be among them) may rightly get a 400 (a keyword the compiler would not enforce, an
empty language, a compile past its time bound, a name not in tools), and each distinct
one costs up to seconds to compile. Bodies that carry one are left out of the fuzzing;
``test_structured_output`` and ``test_tool_calls`` test them, and the fuzzing keeps
``guided_choice``, ``json_object`` and the rule of one constraint at a time, which the
document does state."""

from __future__ import annotations

from typing import Any

import schemathesis

COMPILED = ("guided_json", "guided_regex")


@schemathesis.hook
def filter_body(context: Any, body: Any) -> bool:
    if not isinstance(body, dict):
        return True
    response_format = body.get("response_format")
    tool_choice = body.get("tool_choice")
    return not (any(body.get(name) is not None for name in COMPILED)
                or (isinstance(response_format, dict)
                    and response_format.get("type") == "json_schema")
                or tool_choice == "required" or isinstance(tool_choice, dict))
