"""The run configuration: one YAML file, one typed schema, validated before any work starts.

Every stage loads the same file through `load_config`. A mistake in it (unknown key, wrong type, value out
of range, missing field) raises `ConfigError` with one line naming the file, the key path and what is
allowed; the numbered scripts turn that into exit code 2. The sections `RunConfig` holds are in
config_sections.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from eagle3_pipeline.config_sections import (
    CaptureConfig,
    DataConfig,
    DraftConfig,
    ExportConfig,
    Section,
    TargetConfig,
    TrainConfig,
    ValidateConfig,
    VocabConfig,
    is_runtime,
    nested_models,
)


class ConfigError(Exception):
    """A user mistake in the config file or in a `--set` override (exit code 2)."""


class RunConfig(Section):
    """One run: every stage reads this whole config and writes under `run_dir`."""

    run_dir: Path = Field(description="folder holding each stage's output folder (01_data ... 06_validate)")
    target: TargetConfig = Field(description="the verifier model (01, 02, 04, 06)")
    data: DataConfig = Field(description="conversations and tokenization (01)")
    capture: CaptureConfig = Field(CaptureConfig(), description="hidden-state capture (02)")
    vocab: VocabConfig = Field(VocabConfig(), description="the draft vocabulary (03)")
    draft: DraftConfig = Field(description="the draft's shape and norm layout (03, 04, 05)")
    train: TrainConfig = Field(description="training (04)")
    export: ExportConfig = Field(ExportConfig(), description="export formats (05)")
    validate_: ValidateConfig = Field(ValidateConfig(), alias="validate", description="validation in vLLM (06)")

    @model_validator(mode="after")
    def _one_aux_scaling(self) -> RunConfig:
        # a per-channel scale before a per-row RMSNorm is not a scale of fc's columns: nothing to fold at export
        for norm in ("norm_before_fc", "fc_norm"):
            if self.train.standardize_aux and getattr(self.draft, norm):
                raise ValueError(f"train.standardize_aux scales what draft.{norm} normalises: set one of them")
        return self

    @model_validator(mode="after")
    def _mla_export(self) -> RunConfig:
        # vLLM reads a speculators-format draft's layer config by its model_type, and takes deepseek_v3 for a
        # DeepSeek MTP module; the reference layout names vLLM's MLA draft class (export/format.py)
        if self.draft.attention == "mla" and "speculators" in self.export.formats:
            raise ValueError("draft.attention mla exports the reference layout only: set export.formats [reference]")
        return self

    def section(self, name: str) -> dict[str, Any]:
        """One top-level section as plain JSON data (by its YAML name)."""
        return self.model_dump(mode="json", by_alias=True)[name]


def field_at(dotted_key: str) -> FieldInfo:
    """The schema field a dotted YAML key names (`target`, `capture.stream.window_gb`; a list of sections is
    entered as its entries: `data.sources.limit`)."""
    model, field = RunConfig, None
    for part in dotted_key.split("."):
        if model is None:
            raise KeyError(dotted_key)
        field = next((f for name, f in model.model_fields.items() if (f.alias or name) == part), None)
        if field is None:
            raise KeyError(dotted_key)
        model = next(iter(nested_models(field.annotation)), None)
    return field


def is_runtime_knob(dotted_key: str) -> bool:
    """True when the knob, or a section holding it, says how a stage runs rather than what it makes."""
    parts = dotted_key.split(".")
    return any(is_runtime(field_at(".".join(parts[:n]))) for n in range(1, len(parts) + 1))


def _set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    node = tree
    *parents, leaf = dotted_key.split(".")
    for i, key in enumerate(parents):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted_key}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    node[leaf] = value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> None:
    """Apply `section.key=value` overrides; the value is parsed as YAML (`3`, `true`, `[2, 4]`, `null`)."""
    for override in overrides:
        key, sep, raw = override.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {override!r}: expected section.key=value")
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ConfigError(f"--set {override!r}: value is not valid YAML ({err.problem})") from None
        _set_dotted(tree, key.strip(), value)
        print(f"override: {key.strip()} = {value!r}")


def _describe(error: dict[str, Any]) -> str:
    path = ".".join(str(part) for part in error["loc"] if part != "__root__") or "<top level>"
    kind, message = error["type"], error["msg"]
    if kind == "extra_forbidden":
        return f"{path}: unknown key"
    if kind == "missing":
        return f"{path}: required key is missing"
    if kind == "literal_error":
        return f"{path}: {message.replace('Input should be', 'allowed:')}, got {error['input']!r}"
    if kind == "value_error" and isinstance(error.get("input"), dict):  # a section's own check: the rule says it
        return f"{path}: {message.removeprefix('Value error, ')}"
    return f"{path}: {message}, got {error['input']!r}" if "input" in error else f"{path}: {message}"


def parse_config(tree: Any, source: str) -> RunConfig:
    if not isinstance(tree, dict):
        raise ConfigError(f"{source}: expected a mapping of sections at the top level")
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        problems = [_describe(e) for e in err.errors(include_url=False)]
        raise ConfigError(f"{source}: " + "; ".join(problems)) from None


def load_config(path: str | Path, overrides: list[str] = ()) -> RunConfig:
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config ({err.strerror})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} not valid YAML ({getattr(err, 'problem', err)})") from None
    if isinstance(tree, dict):
        apply_overrides(tree, list(overrides))
    return parse_config(tree, str(path))
