"""Objects close after their declared properties unless the schema says otherwise (pure).

JSON Schema leaves an object open (any further key) where ``additionalProperties`` is not stated,
and llguidance compiles it so; a random-weight model then writes extra keys without end. llama.cpp's
schema converter and xgrammar's strict mode close such objects, and so does ``closed_objects``: a
copy of the schema in which every object schema that declares ``properties`` or ``patternProperties``
and states neither ``additionalProperties`` nor ``unevaluatedProperties`` gets
``"additionalProperties": false``, at any depth: properties, items, prefixItems, contains,
anyOf/oneOf, ``$defs``/``definitions``, the schemas of additionalProperties, patternProperties and
additionalItems. ``{"type": "object"}`` (no declared keys) stays any object.

Left as written, because closing one part would forbid keys another part declares (JSON Schema's
``additionalProperties`` sees only its own schema's ``properties``): the members of allOf, of
if/then/else and of dependentSchemas, anyOf/oneOf members beside the holder's own ``properties``,
and a holder whose such members (or its own ``$ref``) bring keys of their own. Their nested values
are still closed. ``not`` and ``propertyNames`` are not entered (closing inside ``not`` would widen
what it admits).
"""

from __future__ import annotations

from typing import Any

DECLARES = ("properties", "patternProperties")
STATES = ("additionalProperties", "unevaluatedProperties")
SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> a whole value's schema
SCHEMA_LISTS = ("prefixItems",)
SCHEMAS = ("additionalProperties", "additionalItems", "contains", "unevaluatedItems")
ALTERNATIVES = ("anyOf", "oneOf")
COMBINED_LISTS = ("allOf",)
COMBINED = ("if", "then", "else")


def closed_objects(schema: Any) -> Any:
    """``schema`` with its open object schemas closed (see the module); the caller's schema is not
    changed (what changes is copied). Anything that is not a dict (``true``, ``false``) as is."""
    return _close(schema, combined=False)


def _close(schema: Any, combined: bool) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    declares = any(key in schema for key in DECLARES)
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _close(value, False) for name, value in schema[key].items()}
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [_close(value, False) for value in schema[key]]
    for key in SCHEMAS:
        if key in schema:
            out[key] = _close(schema[key], False)
    items = schema.get("items")
    if isinstance(items, list):  # draft 4's tuple
        out["items"] = [_close(value, False) for value in items]
    elif items is not None:
        out["items"] = _close(items, False)
    for key in ALTERNATIVES:
        if isinstance(schema.get(key), list):
            out[key] = [_close(value, declares) for value in schema[key]]
    for key in COMBINED_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [_close(value, True) for value in schema[key]]
    for key in COMBINED:
        if key in schema:
            out[key] = _close(schema[key], True)
    if isinstance(schema.get("dependentSchemas"), dict):
        out["dependentSchemas"] = {name: _close(value, True) for name, value in schema["dependentSchemas"].items()}
    if declares and not combined and not any(key in schema for key in STATES) and not _members_bring_keys(schema):
        out["additionalProperties"] = False
    return out


def _members_bring_keys(schema: dict) -> bool:
    """Whether keys of this object may be declared outside its own ``properties``: by its ``$ref``,
    or by a member it is combined with (allOf, if/then/else, dependentSchemas, anyOf/oneOf)."""
    if "$ref" in schema:
        return True
    members: list[Any] = [schema.get(key) for key in COMBINED]
    for key in (*COMBINED_LISTS, *ALTERNATIVES):
        listed = schema.get(key)
        members += listed if isinstance(listed, list) else []
    if isinstance(schema.get("dependentSchemas"), dict):
        members += list(schema["dependentSchemas"].values())
    return any(isinstance(member, dict) and (any(key in member for key in DECLARES) or "$ref" in member)
               for member in members)
