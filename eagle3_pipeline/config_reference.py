"""Every stage: docs/config.md, the config reference, generated from the schema (config.py, config_sections.py).

    python -m eagle3_pipeline config-reference > docs/config.md

One table per section (in the order a run config nests them): each knob's YAML key, type, default and
description, as pydantic holds them. tests/test_config_reference.py keeps docs/config.md equal to this output.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from eagle3_pipeline.config import RunConfig

HEADER = """# Config reference

Generated from the schema (`eagle3_pipeline/config.py`) by `python -m eagle3_pipeline config-reference`;
`tests/test_config_reference.py` keeps this file equal to it. A run config is one YAML file with `run_dir` and
the sections below; every script takes `--config FILE` and `--set section.key=value` (the value is YAML).
"""


def section_models(model: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(dotted YAML path, model) for `model` and every section nested in it, depth first."""
    found = [(path, model)]
    for name, field in model.model_fields.items():
        for nested in nested_models(field.annotation):
            found += section_models(nested, f"{path}.{field.alias or name}".lstrip("."))
    return found


def nested_models(annotation: Any) -> list[type[BaseModel]]:
    """The sections a field holds: itself, in a list, or optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for argument in typing.get_args(annotation) for model in nested_models(argument)]


def type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation.__name__
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(json.dumps(value) for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(argument) for argument in typing.get_args(annotation))
    if origin is not None:
        arguments = ", ".join(type_name(argument) for argument in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{arguments}]"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return f"`{json.dumps(value, default=str)}`"


def reference() -> str:
    """docs/config.md's text."""
    lines = [HEADER]
    first_path: dict[type[BaseModel], str] = {}
    for path, model in section_models(RunConfig):
        title = path or "top level"
        if model in first_path:  # a section type used twice (data.sources, data.eval_sources)
            lines += [f"## {title}", "", f"Each entry has the keys of `{first_path[model]}`.", ""]
            continue
        first_path[model] = title
        doc = " ".join((model.__doc__ or "").split())
        lines += [f"## {title}", ""] + ([doc, ""] if doc else [])
        lines += ["| key | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            key = field.alias or name
            description = " ".join((field.description or "").split()).replace("|", "\\|")
            lines.append(f"| `{key}` | {type_name(field.annotation)} | {default_text(field)} | {description} |")
        lines.append("")
    return "\n".join(lines)
