"""JSON schemas that structured output's tests walk and its benchmark compiles
(``tests/unit/test_constraints.py``, ``tests/integration/test_structured_output.py``,
``benchmarks/constraint_compile.py``), and what satisfying each means."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openai import OpenAI

#: An enum, bounded strings and a bounded array.
PERSON: dict[str, Any] = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer"},
    "role": {"enum": ["admin", "user"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
}, "required": ["name", "age", "role"]}
#: Nested objects in an array, a string pattern, anyOf with null.
ORDER: dict[str, Any] = {"type": "object", "properties": {
    "id": {"type": "string", "pattern": "[A-Z]{2}[0-9]{6}"},
    "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                         "quantity": {"type": "integer"}},
        "required": ["sku", "quantity"]}},
    "paid": {"type": "boolean"},
    "note": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
}, "required": ["id", "items", "paid"]}


def satisfies_person(value: Any) -> bool:
    """``value`` satisfies PERSON (checked by hand: the schema's every keyword)."""
    return (isinstance(value, dict) and {"name", "age", "role"} <= set(value)
            and set(value) <= set(PERSON["properties"])
            and isinstance(value["name"], str) and len(value["name"]) <= 12
            and type(value["age"]) is int and value["role"] in ("admin", "user")
            and isinstance(value.get("tags", []), list) and len(value.get("tags", [])) <= 2
            and all(isinstance(t, str) and len(t) <= 6 for t in value.get("tags", [])))


def satisfies_order(value: Any) -> bool:
    """``value`` satisfies ORDER (checked by hand)."""
    items = value.get("items") if isinstance(value, dict) else None
    return (isinstance(value, dict) and {"id", "items", "paid"} <= set(value)
            and set(value) <= set(ORDER["properties"])
            and isinstance(value["id"], str) and re.fullmatch("[A-Z]{2}[0-9]{6}", value["id"])
            is not None and isinstance(items, list) and 1 <= len(items) <= 3
            and all(isinstance(i, dict) and set(i) == {"sku", "quantity"}
                    and isinstance(i["sku"], str) and len(i["sku"]) <= 8
                    and type(i["quantity"]) is int for i in items)
            and type(value["paid"]) is bool
            and (value.get("note") is None or (isinstance(value["note"], str)
                                               and len(value["note"]) <= 20)))


def constrained_chat(client: OpenAI, kw: dict[str, Any]) -> str:
    """A chat answer under a constraint (``kw``'s ``response_format``), asked whole and
    streamed: the two the same, and ended by the constraint (finish stop). Its text."""
    full = client.chat.completions.create(**kw)
    streamed = "".join(ch.choices[0].delta.content or "" for ch in
                       client.chat.completions.create(stream=True, **kw) if ch.choices)
    text = full.choices[0].message.content or ""
    assert full.choices[0].finish_reason == "stop" and streamed == text, (text, streamed)
    return text
