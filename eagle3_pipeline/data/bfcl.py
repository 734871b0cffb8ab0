"""BFCL v4 function-calling records as OpenAI records: the questions as messages, the functions as tools.

The `bfcl-eval` wheel ships one JSON-lines file per category, `bfcl_eval/data/BFCL_v4_<category>.json`, each
record `{"id", "question": [[message, ...], ...] (turns of messages), "function": [declaration, ...]}` with
BFCL's Gorilla parameter types ("dict", "float", "tuple", ...). The tools are what BFCL's own generation sends
an OpenAI-style function-calling model (its chat-completions handler, through which it runs Kimi's models too): each
ends with BFCL's note on the functions' syntax, dots in names become underscores (OpenAI's names allow none),
and types become JSON-schema types through BFCL's `GORILLA_TO_OPENAPI`, a missing or unknown one "string", a
"float" also marked `"format": "float"` and noted in its description, nested properties and items converted
alike. The answers are left to the target (regeneration), so the prompts measure tool-call acceptance.
"""

from __future__ import annotations

import functools
from typing import Any

from eagle3_pipeline.data.conversations import InvalidConversation

PACKAGE = "bfcl-eval"
SYNTAX_NOTE = " Note that the provided function is in Python 3 syntax."  # BFCL's, for every category read here
FLOAT_NOTE = " This is a float type value."  # BFCL's, beside "format": "float"


def category_file(category: str) -> str:
    """A category's file inside the installed package's folder."""
    return f"bfcl_eval/data/BFCL_v4_{category}.json"


def to_openai(record: Any) -> dict[str, Any]:
    """A BFCL record as an OpenAI record (`messages`, the turns' messages in order; `tools`); raises
    InvalidConversation when its questions or functions are not in BFCL's shape."""
    if not isinstance(record, dict):
        raise InvalidConversation("malformed_json")
    turns, functions = record.get("question"), record.get("function")
    if not isinstance(turns, list) or not turns or not all(isinstance(turn, list) for turn in turns):
        raise InvalidConversation("no_messages")
    if not isinstance(functions, list):
        raise InvalidConversation("malformed_functions")
    return {"messages": [message for turn in turns for message in turn],
            "tools": [{"type": "function", "function": _function(function)} for function in functions]}


def _function(function: Any) -> dict[str, Any]:
    """A declaration as BFCL's `convert_to_tool` writes it for OpenAI's chat completions."""
    if not isinstance(function, dict):
        raise InvalidConversation("malformed_functions")
    parameters = function.get("parameters")
    if not (isinstance(function.get("name"), str) and isinstance(function.get("description"), str)
            and isinstance(parameters, dict) and isinstance(parameters.get("properties"), dict)):
        raise InvalidConversation("malformed_functions")
    return function | {
        "name": function["name"].replace(".", "_"),
        "description": function["description"] + SYNTAX_NOTE,
        "parameters": parameters | {"type": "object", "properties": _properties(parameters["properties"])},
    }


def _properties(properties: dict[str, Any]) -> dict[str, Any]:
    return {name: _json_schema(schema) for name, schema in properties.items()}


def _json_schema(schema: Any, item: bool = False) -> dict[str, Any]:
    """A parameter's schema (or an array's `item` schema) in JSON-schema types: BFCL's `_cast_to_openai_type`,
    which notes floats in parameters only, applied at every depth (BFCL's stops two levels of items down)."""
    if not isinstance(schema, dict):
        raise InvalidConversation("malformed_functions")
    gorilla_type = schema.get("type", "string")
    converted = schema | {"type": _gorilla_to_openapi().get(gorilla_type, "string")}
    if gorilla_type == "float" and not item:
        converted |= {"format": "float", "description": schema.get("description", "") + FLOAT_NOTE}
    if isinstance(schema.get("properties"), dict):
        converted["properties"] = _properties(schema["properties"])
    elif "items" in schema:
        converted["items"] = _json_schema(schema["items"], item=True)
    return converted


@functools.cache
def _gorilla_to_openapi() -> dict[str, str]:
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI  # a module of plain dicts: no dependencies

    return GORILLA_TO_OPENAPI
