"""JSON schemas that structured output's tests walk and its benchmark compiles
(``tests/unit/test_constraints.py``, ``benchmarks/constraint_compile.py``)."""

from __future__ import annotations

from typing import Any

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
