"""Output knobs and runtime knobs (config_sections.runtime), walked one by one on a finished run: a runtime knob
changed leaves every stage complete and partial work resumable; an output knob changed makes exactly the stages
that read it, and those made from them, stale, and the stale message names the knob with both values."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest

from eagle3_pipeline.config import RunConfig, is_runtime_knob, load_config, parse_config
from eagle3_pipeline.config_reference import section_models
from eagle3_pipeline.config_sections import nested_models
from eagle3_pipeline.stage_io import STAGES, Stage, stages_made_stale_by
from tests.conftest import CONFIGS, run_python
from tests.stage_reads import changed_config

# A knob no other value of its own can change while the config stays valid: changed together with its partner.
# draft.attention mla and its sizes are valid only together (config_sections.DraftConfig)
MLA_DRAFT = {"draft.attention": "mla", "draft.q_lora_rank": 48, "draft.kv_lora_rank": 32,
             "draft.qk_nope_head_dim": 16, "draft.qk_rope_head_dim": 8, "draft.v_head_dim": 16}
MLA_DRAFT_EXPORT = {"export.formats": ["reference"]}  # its only format
PAIRED = {
    "target.path": {"target.stand_in": None},  # exactly one of path and stand_in
    "draft.norm_before_fc": {"train.standardize_aux": False},  # the config refuses both (config.py)
    "draft.fc_norm": {"train.standardize_aux": False},
    **{key: {**{other: value for other, value in MLA_DRAFT.items() if other != key}, **MLA_DRAFT_EXPORT}
       for key in MLA_DRAFT},
}
PAIRED_VALUES = {"target.path": "/models/other-target", "draft.norm_before_fc": True, "draft.fc_norm": True,
                 **MLA_DRAFT}

# What the issue that introduced the two kinds names, by hand: the stages each change must make stale.
EXPECTED_BY_HAND = {
    "target.engine.gpu_memory_utilization": [], "target.engine.max_num_seqs": [], "target.engine.cpu_reserved_cores": [],
    "target.engine.kv_cache_memory_gb": [], "target.engine.enforce_eager": [], "target.engine.tensor_parallel_size": [],
    "train.num_workers": [], "train.log_every": [], "train.checkpoint_every": [], "train.eval_every": [],
    "capture.batch_size": [], "capture.samples_per_shard": [], "capture.stream.window_gb": [],
    "data.regenerate.chunk_size": [],
    "data.max_seq_len": list(STAGES), "target.engine.max_model_len": list(STAGES),
    "capture.dtype": ["02_hidden_states", "04_train", "05_export", "06_validate"],
    "draft.draft_vocab_size": ["03_vocab", "04_train", "05_export", "06_validate"],
    "draft.norm_output": ["04_train", "05_export", "06_validate"],
    "train.learning_rate": ["04_train", "05_export", "06_validate"],
    "validate.max_tokens": ["04_train", "05_export", "06_validate"],  # 04 simulates 06's acceptance
    "export.formats": ["05_export", "06_validate"],
    "validate.max_prompts": ["06_validate"],
}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> RunConfig:
    """01-05 finished and 06 begun (partial) under configs/demo.yaml, every optional section present."""
    tmp = tmp_path_factory.mktemp("knobs")
    for name in ("draft", "other-draft"):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text("{}")
    config = load_config(CONFIGS / "demo.yaml", [
        f"run_dir={tmp / 'run'}", f"data.regenerate.speculative={{draft: {tmp / 'draft'}}}",
        "export.target_facts={vocab_size: 49152, num_hidden_layers: 30}"])
    for name in STAGES:
        stage = Stage(config, name)
        stage.begin()
        if name != "06_validate":
            stage.finish()
    return config


def every_knob() -> list[str]:
    """Every knob of the schema but run_dir (where the run lives: another run_dir is another run)."""
    return [key for path, model in section_models(RunConfig) for name, field in model.model_fields.items()
            if not nested_models(field.annotation) and (key := f"{path}.{field.alias or name}".lstrip(".")) != "run_dir"]


def changed(config: RunConfig, key: str) -> tuple[RunConfig, list[str]]:
    """`config` with `key` set to another valid value, and every key that changed with it."""
    if key not in PAIRED:
        if key == "data.regenerate.speculative.draft":
            return _with(config, {key: str(Path(config.data.regenerate.speculative.draft).parent / "other-draft")}), [key]
        other = changed_config(config, key)
        assert other is not None, f"no other valid value for {key}"
        return other, [key]
    return _with(config, {key: PAIRED_VALUES[key], **PAIRED[key]}), [key, *PAIRED[key]]


def _with(config: RunConfig, values: dict) -> RunConfig:
    tree = copy.deepcopy(config.model_dump(mode="json", by_alias=True))
    for key, value in values.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = value
    return parse_config(tree, "changed")


def is_current(state: str) -> bool:
    return state == "complete" or state.startswith("partial: rerunning")


def test_the_finished_run_is_current_as_it_is(finished_run):
    states = {name: Stage(finished_run, name).state() for name in STAGES}
    assert states == {**{name: "complete" for name in STAGES if name != "06_validate"},
                      "06_validate": "partial: rerunning its script resumes it"}


@pytest.mark.parametrize("key", every_knob())
def test_each_knob_makes_exactly_its_stages_stale(finished_run, key):
    other, keys = changed(finished_run, key)
    runtime = [k for k in keys if is_runtime_knob(k)]
    expected = [name for name in STAGES if any(name in stages_made_stale_by(k) for k in keys if k not in runtime)]
    if key in EXPECTED_BY_HAND:
        assert expected == EXPECTED_BY_HAND[key]
    states = {name: Stage(other, name).state() for name in STAGES}
    stale = [name for name, state in states.items() if not is_current(state)]
    assert stale == expected, states
    if stale:
        first = states[stale[-1]]
        named = re.sub(r"\[\d+\]", "", first)  # data.sources[0].limit names data.sources.limit
        assert re.search(rf"{re.escape(key)}[.:]", named) and " -> " in first, first  # the knob, recorded -> current


def test_the_stale_message_names_the_knob_its_values_and_the_earliest_stage(finished_run):
    other = _with(finished_run, {"capture.dtype": "fp8", "validate.max_tokens": 64})
    state = Stage(other, "06_validate").state()
    assert 'capture.dtype: "bfloat16" -> "fp8"' in state and "02_generate_hidden_states.py" in state
    assert "validate.max_tokens" not in state  # 02 comes first: rerunning it reruns 04, which reads max_tokens


def test_a_partial_stage_resumes_under_a_new_runtime_value_and_keeps_its_pieces(finished_run, capsys):
    other = _with(finished_run, {"target.engine.max_num_seqs": 3, "capture.samples_per_shard": 7})
    stage = Stage(other, "06_validate")
    stage.begin()
    assert "resuming partial work" in capsys.readouterr().out
    assert stage.layout_knob("capture.samples_per_shard") == finished_run.capture.samples_per_shard != 7
    began = finished_run.capture.samples_per_shard
    assert (f"resuming in the pieces its work began with: capture.samples_per_shard {began} (the config's 7 applies "
            f"to a fresh run)") in capsys.readouterr().out


def test_stages_command_shows_each_stage_state(finished_run, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(__import__("yaml").safe_dump(finished_run.model_dump(mode="json", by_alias=True)))
    shown = run_python("-m", "eagle3_pipeline", "stages", "--config", str(config), "--set", "draft.norm_output=true")
    assert shown.returncode == 0, shown.stderr
    states = [line.split(None, 1)[1] for line in shown.stdout.splitlines() if line.startswith("  state")]
    assert states[:3] == ["complete"] * 3
    assert states[3].startswith("stale: ") and "draft.norm_output: false -> true" in states[3]
    assert states[5].startswith("partial, and its inputs are not current")
