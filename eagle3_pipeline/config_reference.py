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

from eagle3_pipeline.config import RunConfig, is_runtime_knob
from eagle3_pipeline.config_sections import nested_models
from eagle3_pipeline.stage_io import STAGES, stages_made_stale_by

HEADER = """# Config reference

Generated from the schema (`eagle3_pipeline/config.py`) by `python -m eagle3_pipeline config-reference`;
`tests/test_config_reference.py` keeps this file equal to it. A run config is one YAML file with `run_dir` and
the sections below; every script takes `--config FILE` and `--set section.key=value` (the value is YAML).

Column `kind`: a knob either defines what stages make (`output`, followed by the stages a change makes stale:
those that read it and every stage made from them; rerun from the first) or says only how a stage runs
(`runtime`: memory, workers, cadences, chunk sizes, timeouts). Changing a runtime knob leaves every finished stage
complete, and partial work resumes under the new value. `runtime, within noise` marks the few that can move
results by float rounding only; the description says why. `python -m eagle3_pipeline stages --config FILE` shows
each stage's state in a run_dir, and a stale stage names the knobs that changed.
"""


def section_models(model: type[BaseModel], path: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(dotted YAML path, model) for `model` and every section nested in it, depth first."""
    found = [(path, model)]
    for name, field in model.model_fields.items():
        for nested in nested_models(field.annotation):
            found += section_models(nested, f"{path}.{field.alias or name}".lstrip("."))
    return found


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


def knob_kind(key: str, field) -> str:
    """`output (NN, ...)`, `runtime` or `runtime, within noise`; `section` for a section of knobs of both kinds."""
    if is_runtime_knob(key):
        return "runtime, within noise" if (field.json_schema_extra or {}).get("within_noise") else "runtime"
    if nested_models(field.annotation):
        return "section"
    stale = stages_made_stale_by(key)
    return f"output ({', '.join(name[:2] for name in stale)})" if stale else "output (where the run lives)"


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
        lines += ["| key | type | default | kind | description |", "|---|---|---|---|---|"]
        for name, field in model.model_fields.items():
            key = field.alias or name
            noise = (field.json_schema_extra or {}).get("within_noise")
            description = field.description + (f". Within noise: {noise}" if noise else "")
            description = " ".join(description.split()).replace("|", "\\|")
            kind = knob_kind(f"{path}.{key}".lstrip("."), field)
            lines.append(f"| `{key}` | {type_name(field.annotation)} | {default_text(field)} | {kind} | {description} |")
        lines.append("")
    return "\n".join(lines)


def stage_table() -> str:
    """The README's table of the stages, from stage_io.STAGES: each script, the earlier stages' folders it reads,
    the config entries whose output knobs its output depends on, and what it writes."""
    rows = ["| script | reads | depends on (config) | writes |", "|---|---|---|---|"]
    for spec in STAGES.values():
        reads = ", ".join(f"`{name}/`" for name in spec.inputs) or "the data sources and the target"
        sections = ", ".join(f"`{entry}`" for entry in spec.sections)
        rows.append(f"| `{spec.script}` | {reads} | {sections} | `{spec.name}/`: {spec.writes} |")
    return "\n".join(rows)
