"""A schema made ready for llguidance accepts exactly what it accepted: integer-valued counts and
draft 4's boolean exclusive bounds rewritten, a oneOf of disjoint values made an anyOf (exact),
every other oneOf left for llguidance to hold exactly or refuse; values (const, enum) untouched."""

from __future__ import annotations

import jsonschema
import pytest

from moed.daemon.engine.schema_prep import prepared


def test_integer_valued_counts_become_integers_everywhere_a_subschema_is():
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "minItems": 1.0, "items": {"maxLength": 3.0}}},
        "$defs": {"s": {"type": "string", "minLength": 2.0}},
        "const_like": {"minItems": 1.5},  # not a count keyword's position: left alone
    }
    out = prepared(schema)
    assert (
        out["properties"]["a"]["minItems"] == 1 and type(out["properties"]["a"]["minItems"]) is int
    )
    assert type(out["properties"]["a"]["items"]["maxLength"]) is int
    assert type(out["$defs"]["s"]["minLength"]) is int
    assert prepared({"const": {"minItems": 1.0}}) == {"const": {"minItems": 1.0}}


@pytest.mark.parametrize(
    "draft4, now",
    [
        ({"minimum": 5, "exclusiveMinimum": True}, {"exclusiveMinimum": 5}),
        ({"maximum": 5, "exclusiveMaximum": False}, {"maximum": 5}),
        ({"exclusiveMinimum": 2}, {"exclusiveMinimum": 2}),  # already 2020-12
    ],
)
def test_draft4_exclusive_bounds_become_2020_12s(draft4, now):
    assert prepared({"type": "number", **draft4}) == {"type": "number", **now}


def test_a_one_of_of_disjoint_values_is_an_any_of_and_others_stay():
    titled = {"oneOf": [{"const": "r", "title": "Red"}, {"enum": ["g", 1]}]}
    assert prepared(titled) == {"anyOf": titled["oneOf"]}
    for overlapping in (
        {"oneOf": [{"const": 1}, {"enum": [1.0, 2]}]},  # 1 and 1.0 are one value
        {"oneOf": [{"const": 1}, {"type": "integer"}]},
        {"oneOf": [{"minLength": 2}, {"maxLength": 4}]},
    ):
        assert prepared(overlapping) == overlapping
    both = {"anyOf": [{"type": "string"}], "oneOf": [{"const": "a"}, {"const": "b"}]}
    out = prepared(both)
    assert out == {"anyOf": [{"type": "string"}], "allOf": [{"anyOf": both["oneOf"]}]}
    for value in ("a", "b", "c", 1):  # the same answers pass as before
        assert _valid(value, out) == _valid(value, both)


def _valid(value, schema) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True
