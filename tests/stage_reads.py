"""Fingerprints from reads: the config keys each stage's code read while it ran (recorded through
tests/read_recorder.py) against what makes the stage stale (its fingerprint, and those of the stages
before it). Used by the runs that execute every stage (tests/test_pipeline_tiny_kimi.py, offline) and by the
stream-mode run of 02 and 04 (tests/capture/test_stream_capture.py)."""

from __future__ import annotations

import copy
import json
import types
import typing
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import ConfigError, RunConfig, field_at, is_runtime_knob, parse_config
from eagle3_pipeline.config_sections import MLA_SIZES
from eagle3_pipeline.stage_io import STAGES, Stage, StageError, upstream_of
from eagle3_pipeline.target import target_facts

LOCATION = {"run_dir"}  # where a run lives, not what it makes
# knobs that no other value of their own can change while the rest of the config stays valid
BOUND = {**{norm: "train.standardize_aux (on in the configs) scales what it normalises: the config refuses both"
            for norm in ("draft.norm_before_fc", "draft.fc_norm")},
         **{key: "valid only together (attention mla with its five sizes): tests/test_knob_kinds.py changes them so"
            for key in ("draft.attention", *(f"draft.{size}" for size in MLA_SIZES))}}


# read by 02 in stream mode only to send its packs in 04's order (pack_plan.plan_settings); 04 refuses a stream
# planned under other values before reading any of it (tests/train/test_inputs.py), so 02's fingerprint need not
# hold them
STREAM_ORDER = {"train.packed_length", "train.seed"}


def covering(name: str) -> tuple[str, ...]:
    """The config entries whose change makes stage `name` stale: its own and its earlier stages' fingerprints."""
    return tuple(entry for stage in (name, *upstream_of(name)) for entry in STAGES[stage].sections)


def is_covered(key: str, entries: tuple[str, ...]) -> bool:
    return key in LOCATION or any(key == entry or key.startswith(entry + ".") for entry in entries)


def recorded_reads(reads_dir: Path, names: tuple[str, ...] = tuple(STAGES)) -> dict[str, list[str]]:
    """Stage name -> the config keys its script read."""
    return {name: json.loads((reads_dir / f"{Path(STAGES[name].script).stem}.json").read_text()) for name in names}


def uncovered_reads(reads: dict[str, list[str]]) -> dict[str, list[str]]:
    """Per stage, each output knob it read that neither its fingerprint nor an earlier stage's covers."""
    found = {name: [k for k in keys if not is_covered(k, covering(name)) and not is_runtime_knob(k)
                    and not (name == "02_hidden_states" and k in STREAM_ORDER)]
             for name, keys in reads.items()}
    return {name: keys for name, keys in found.items() if keys}


def candidates(value: Any, annotation: Any) -> list[Any]:
    """Other values of a knob's type, to try in turn until one validates."""
    options = list(typing.get_args(annotation)) if typing.get_origin(annotation) is typing.Literal else []
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):  # Optional[Literal[...]]
        for argument in typing.get_args(annotation):
            if typing.get_origin(argument) is typing.Literal:
                options += list(typing.get_args(argument))
    if options:
        return [option for option in options if option != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value - 1, value * 2, value // 2]
    if isinstance(value, float):
        return [value * 0.5, value + 0.1, value * 2, 0.1]
    if isinstance(value, str):
        return [value + "-changed"]
    if isinstance(value, list):
        numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
        same_length = [[v * 0.99 for v in value]] if value and numbers else []
        return same_length + ([value[:-1], value + value[-1:], [1]] if value else [[1], [2, 4, 5]])
    if isinstance(value, dict):
        return [{**value, "changed": True}]
    if value is None:
        return [1, [1, 2, 3], True, "changed", 0.5, {"rope_type": "linear", "factor": 2.0}]
    return []


def changed_config(config: RunConfig, key: str) -> RunConfig | None:
    """`config` with knob `key` (in a list of sections: in one of its entries) set to another valid value."""
    tree = config.model_dump(mode="json", by_alias=True)
    for node in sections_holding(tree, key.split(".")[:-1]):
        leaf = key.split(".")[-1]
        special = [target_facts(config)] if key == "export.target_facts" else []  # facts must match the target
        for candidate in special + candidates(node[leaf], field_at(key).annotation):
            if candidate == node[leaf]:
                continue
            original, node[leaf] = node[leaf], candidate
            try:
                return parse_config(copy.deepcopy(tree), "changed")
            except ConfigError:
                continue
            finally:
                node[leaf] = original
    return None


def sections_holding(node: Any, parents: list[str]) -> list[dict]:
    """The section dicts at `parents` below `node` (every entry of a list of sections)."""
    if not parents:
        return node if isinstance(node, list) else [node]
    child = node[parents[0]]
    return [found for item in (child if isinstance(child, list) else [child])
            for found in sections_holding(item, parents[1:])]


def still_complete(config: RunConfig, name: str) -> bool:
    try:
        return Stage(config, name).is_complete()
    except StageError:
        return False


def check_fingerprints_cover_reads(config: RunConfig, reads_dir: Path) -> dict[str, int]:
    """Every output knob each stage read is covered, and changing it leaves that stage no longer complete (a runtime
    knob read changes nothing: tests/test_knob_kinds.py); the number of keys changed per stage."""
    reads = recorded_reads(reads_dir)
    assert not uncovered_reads(reads), f"keys read but not fingerprinted: {uncovered_reads(reads)}"
    assert all(still_complete(config, name) for name in STAGES), "the finished run must be complete as it is"
    changed_per_stage = {}
    for name, keys in reads.items():
        keys = [k for k in keys if k not in LOCATION and k not in BOUND and not is_runtime_knob(k)]
        unchangeable = [k for k in keys if changed_config(config, k) is None]
        assert not unchangeable, f"{name}: no other valid value found for {unchangeable}"
        stale_missed = [k for k in keys if still_complete(changed_config(config, k), name)]
        assert not stale_missed, f"{name} stays complete when these keys it reads change: {stale_missed}"
        changed_per_stage[name] = len(keys)
    return changed_per_stage
