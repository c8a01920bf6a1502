"""``closed_objects``: object schemas that declare properties and leave ``additionalProperties``
unstated come back closed, at every depth a value's schema can sit; stated ones, undeclared ones and
the parts of an object combined from several schemas stay as written; the caller's schema is not
changed."""

from __future__ import annotations

import copy

import pytest

from stages.guided.closed import closed_objects

pytestmark = pytest.mark.unit

OPEN = {"type": "object", "properties": {"a": {"type": "integer"}}}
SHUT = {**OPEN, "additionalProperties": False}


def test_an_object_with_properties_closes():
    assert closed_objects(OPEN) == SHUT
    assert closed_objects({"type": "object", "properties": {}}) == {"type": "object", "properties": {},
                                                                     "additionalProperties": False}
    assert closed_objects({"patternProperties": {"^x": {}}}) == {"patternProperties": {"^x": {}},
                                                                 "additionalProperties": False}


def test_what_the_schema_states_or_does_not_declare_stays():
    for schema in ({**OPEN, "additionalProperties": True}, {**OPEN, "additionalProperties": {"type": "string"}},
                   {**OPEN, "unevaluatedProperties": False}, {"type": "object"},
                   {"type": "object", "required": ["a"]}, {"type": "string"}, True, False):
        assert closed_objects(schema) == schema


def test_every_place_a_value_schema_sits_is_closed():
    schema = {"type": "object", "properties": {
        "nested": OPEN,
        "list": {"type": "array", "items": OPEN},
        "tuple": {"type": "array", "prefixItems": [OPEN], "items": OPEN, "contains": OPEN},
        "draft4": {"type": "array", "items": [OPEN], "additionalItems": OPEN},
        "either": {"anyOf": [OPEN, {"type": "null"}]},
        "one": {"oneOf": [OPEN]},
        "map": {"type": "object", "additionalProperties": OPEN},
        "pattern": {"type": "object", "patternProperties": {"^k": OPEN}, "additionalProperties": False},
    }, "$defs": {"D": OPEN}, "definitions": {"E": OPEN}}
    assert closed_objects(schema) == {"type": "object", "properties": {
        "nested": SHUT,
        "list": {"type": "array", "items": SHUT},
        "tuple": {"type": "array", "prefixItems": [SHUT], "items": SHUT, "contains": SHUT},
        "draft4": {"type": "array", "items": [SHUT], "additionalItems": SHUT},
        "either": {"anyOf": [SHUT, {"type": "null"}]},
        "one": {"oneOf": [SHUT]},
        "map": {"type": "object", "additionalProperties": SHUT},
        "pattern": {"type": "object", "patternProperties": {"^k": SHUT}, "additionalProperties": False},
    }, "additionalProperties": False, "$defs": {"D": SHUT}, "definitions": {"E": SHUT}}


def test_an_object_combined_from_several_schemas_stays_open_and_its_values_close():
    """Closing one part of an allOf (or the holder) would forbid the keys the other part declares."""
    both = {"properties": {"a": OPEN}, "allOf": [{"properties": {"b": OPEN}, "required": ["b"]}]}
    assert closed_objects(both) == {"properties": {"a": SHUT},
                                    "allOf": [{"properties": {"b": SHUT}, "required": ["b"]}]}
    conditional = {"if": {"properties": {"k": {"const": 1}}}, "then": {"properties": {"b": {}}},
                   "else": {"properties": {"c": {}}}}
    assert closed_objects(conditional) == conditional
    beside = {"properties": {"kind": {"type": "string"}}, "anyOf": [{"properties": {"x": {}}}]}
    assert closed_objects(beside) == beside
    extended = {"$ref": "#/$defs/Base", "properties": {"extra": {}}, "$defs": {"Base": OPEN}}
    assert closed_objects(extended) == {**extended, "$defs": {"Base": SHUT}}
    dependent = {"properties": {"a": {}}, "dependentSchemas": {"a": {"properties": {"b": {}}}}}
    assert closed_objects(dependent) == dependent


def test_a_holder_whose_members_bring_no_keys_closes():
    schema = {**OPEN, "allOf": [{"required": ["a"]}]}
    assert closed_objects(schema) == {**schema, "additionalProperties": False}


def test_not_and_property_names_are_not_entered():
    schema = {"not": OPEN, "propertyNames": OPEN}
    assert closed_objects(schema) == schema


def test_the_callers_schema_is_not_changed():
    schema = {"type": "object", "properties": {"a": OPEN, "b": {"type": "array", "items": OPEN}},
              "$defs": {"D": OPEN}, "anyOf": [{"required": ["a"]}]}
    before = copy.deepcopy(schema)
    closed_objects(schema)
    assert schema == before
