"""A JSON Schema made ready for llguidance without changing what it accepts.

- Counts written as integer-valued numbers (`minItems: 1.0`, an integer in draft 2020-12) become
  integers, which llguidance requires.
- Draft 4's boolean `exclusiveMinimum`/`exclusiveMaximum` (beside `minimum`/`maximum`) become
  2020-12's numbers.
- A `oneOf` whose branches are only `const`/`enum` with no value in two branches is an `anyOf`:
  exactly one branch can match, so nothing is weakened. Any other `oneOf` goes to llguidance as it
  is, which holds it exactly where its branches cannot overlap (different types, a discriminating
  const) and refuses it otherwise: never the silent `anyOf` that would accept an answer matching
  several branches.
"""

from __future__ import annotations

import json
from typing import Any

from moed.daemon.engine.tool_format import ANNOTATIONS

_COUNTS = frozenset(
    {"minItems", "maxItems", "minLength", "maxLength", "minProperties", "maxProperties"}
    | {"minContains", "maxContains"}
)
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SCHEMA = frozenset(
    {"items", "additionalItems", "additionalProperties", "not", "if", "then", "else"}
    | {"contains", "propertyNames", "unevaluatedItems", "unevaluatedProperties"}
)
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


_VALUES_ONLY = ANNOTATIONS | {"const", "enum"}


def prepared(schema: Any) -> Any:
    """The schema with the rewrites above, everywhere a subschema can be (values as `const`,
    `enum` and `default` are left as they are)."""
    if isinstance(schema, list):
        return [prepared(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: prepared(sub) for name, sub in value.items()}
        elif key in _SCHEMA or (key in _SCHEMA_LISTS and isinstance(value, list)):
            out[key] = prepared(value)
        elif key in _COUNTS and isinstance(value, float) and value.is_integer():
            out[key] = int(value)
        else:
            out[key] = value
    _draft4_exclusive(out)
    if isinstance(out.get("oneOf"), list) and _disjoint_values(out["oneOf"]):
        branches = out.pop("oneOf")
        if "anyOf" in out:  # both: the schema's own anyOf holds as well
            out["allOf"] = [*(out.get("allOf") or []), {"anyOf": branches}]
        else:
            out["anyOf"] = branches
    return out


def _draft4_exclusive(schema: dict[str, Any]) -> None:
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        flag = schema.get(exclusive)
        if isinstance(flag, bool):
            del schema[exclusive]
            if flag and bound in schema:
                schema[exclusive] = schema.pop(bound)


def _disjoint_values(branches: list[Any]) -> bool:
    """Every branch is a `const` or an `enum` (and annotations), and no value is in two."""
    seen: set[str] = set()
    for branch in branches:
        if not isinstance(branch, dict) or not ANNOTATIONS.issuperset(
            set(branch) - {"const", "enum"}
        ):
            return False
        if ("const" in branch) == ("enum" in branch):
            return False
        values = [branch["const"]] if "const" in branch else branch["enum"]
        if not isinstance(values, list):
            return False
        keys = {_value_key(v) for v in values}
        if keys & seen:
            return False
        seen |= keys
    return True


def _value_key(value: Any) -> str:
    """A value as JSON Schema compares it: 1 and 1.0 are one value, true and 1 are not."""
    return json.dumps(_canonical(value), sort_keys=True)


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_canonical(v) for v in value]
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    return value
