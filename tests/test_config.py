"""The run config: every shipped file validates; every kind of mistake exits 2 naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.config import ConfigError, RunConfig, load_config
from eagle3_pipeline.config_reference import section_models
from eagle3_pipeline.reference import REFERENCE_DRAFT_SPEC
from tests.conftest import CONFIGS, run_python

SHIPPED = sorted(CONFIGS.rglob("*.yaml"))


def test_every_shipped_config_validates():
    assert [p.name for p in SHIPPED] == ["demo.yaml", "demo_gpu.yaml", "demo_kimi_gpu.yaml", "kimi_k25.yaml",
                                        "tiny_kimi.yaml"]
    for path in SHIPPED:
        load_config(path)


def test_kimi_draft_is_the_reference_shape():
    reference = json.loads(REFERENCE_DRAFT_SPEC.read_text())
    ref = reference["config"]
    config = load_config(CONFIGS / "kimi_k25.yaml")
    draft = config.draft
    assert (draft.hidden_size, draft.num_attention_heads, draft.num_key_value_heads, draft.head_dim) == (
        ref["hidden_size"], ref["num_attention_heads"], ref["num_key_value_heads"], ref["head_dim"])
    assert draft.intermediate_size == ref["intermediate_size"]
    assert draft.draft_vocab_size == ref["draft_vocab_size"]
    assert draft.rope_theta == ref["rope_theta"] and draft.rope_scaling is ref["rope_scaling"]
    assert draft.max_position_embeddings == ref["max_position_embeddings"]
    assert draft.rms_norm_eps == ref["rms_norm_eps"]
    assert draft.norm_before_residual is False
    assert config.capture.aux_layer_ids == ref["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert config.target.engine.tensor_parallel_size == 8


def test_tiny_kimi_draft_keeps_heads_wider_than_hidden():
    draft = load_config(CONFIGS / "tiny_kimi.yaml").draft
    assert draft.num_attention_heads * draft.head_dim > draft.hidden_size


def _broken(tmp_path: Path, edit) -> Path:
    tree = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    edit(tree)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize(
    ("edit", "key", "says"),
    [
        (lambda t: t["train"].update(learning_rat=t["train"].pop("learning_rate")), "train.learning_rat", "unknown key"),
        (lambda t: t["draft"].update(head_dim="wide"), "draft.head_dim", "valid integer"),
        (lambda t: t["draft"].pop("draft_vocab_size"), "draft.draft_vocab_size", "required key is missing"),
        (lambda t: t["capture"].update(dtype="int3"), "capture.dtype", "allowed: 'bfloat16' or 'fp8'"),
        (lambda t: t["train"].update(ttt_steps=9), "train.ttt_steps", "less than or equal to 7"),
    ],
    ids=["misspelt-key", "wrong-type", "missing-field", "not-allowed", "out-of-range"],
)
def test_broken_config_exits_2_with_one_line_naming_the_key(tmp_path, edit, key, says):
    path = _broken(tmp_path, edit)
    result = run_python("-m", "eagle3_pipeline", "config", str(path))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert str(path) in lines[0] and key in lines[0] and says in lines[0], lines[0]
    assert "Traceback" not in result.stderr


def test_overrides_go_through_validation(tmp_path):
    config = load_config(CONFIGS / "demo.yaml", ["train.max_steps=70", "capture.aux_layer_ids=[1, 2, 3]"])
    assert config.train.max_steps == 70 and config.capture.aux_layer_ids == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"train\.max_steps: .*greater than or equal to 1"):
        load_config(CONFIGS / "demo.yaml", ["train.max_steps=0"])
    with pytest.raises(ConfigError, match=r"expected section.key=value"):
        load_config(CONFIGS / "demo.yaml", ["train.max_steps"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("target.path=/models/x", "set exactly one of target.path and target.stand_in"),
        ("train.ttt_step_weights=[1, 1]", "ttt_step_weights needs 3 values"),
        ("draft.num_key_value_heads=2", "multiple of num_key_value_heads"),
        ("capture.aux_layer_ids=[2, 2]", "distinct"),
        ("capture.aux_layer_ids=[3, 1, 2]", "ascending"),  # vLLM hands them over in ascending order
        ("validate.latency_concurrency=[1, 0]", "requests at once are at least 1"),
        # the demo standardises the aux states; an input norm would normalise them again
        ("draft.norm_before_fc=true", r"^[^{]*train.standardize_aux scales what draft.norm_before_fc normalises[^{]*$"),
        ("draft.fc_norm=true", r"^[^{]*train.standardize_aux scales what draft.fc_norm normalises[^{]*$"),
    ],
)
def test_cross_field_rules(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / "demo.yaml", [override])


def test_one_norm_before_fc():
    """norm_before_fc normalises the concatenated aux states, fc_norm each one: speculators refuses both."""
    with pytest.raises(ConfigError, match="norm_before_fc and fc_norm both normalise fc's input"):
        load_config(CONFIGS / "demo.yaml", ["train.standardize_aux=false", "draft.norm_before_fc=true",
                                            "draft.fc_norm=true"])


MLA_SIZES = ["draft.q_lora_rank=96", "draft.kv_lora_rank=512", "draft.qk_nope_head_dim=32",
             "draft.qk_rope_head_dim=64", "draft.v_head_dim=32", "export.formats=[reference]"]


@pytest.mark.parametrize(("overrides", "message"), [
    (["draft.attention=mla"], "attention mla needs q_lora_rank, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, "
                              "v_head_dim"),
    (["draft.attention=mla", *MLA_SIZES[1:]], "attention mla needs q_lora_rank \\("),
    (MLA_SIZES[1:2], "kv_lora_rank apply to attention mla only; attention is llama"),
    (["draft.attention=mla", *MLA_SIZES[:3], "draft.qk_rope_head_dim=63", "draft.v_head_dim=32"], "must be even"),
    (["draft.attention=mla", *MLA_SIZES[:-1]], "exports the reference layout only"),
    (["draft.attention=mla", *MLA_SIZES, "draft.norm_before_fc=true", "train.standardize_aux=false"],
     "vLLM's MLA draft has no norm_before_fc"),
])
def test_mla_sizes_go_with_attention_mla(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(CONFIGS / "demo.yaml", overrides)
    assert load_config(CONFIGS / "demo.yaml", ["draft.attention=mla", *MLA_SIZES]).draft.qk_head_dim == 96


def test_regeneration_draft_is_a_folder_checked_at_load(tmp_path):
    """data.regenerate.speculative: null by default; a draft folder (either export format holds config.json) with
    k defaulting to 3; a folder that is not there is one line naming the key, before any stage starts."""
    assert load_config(CONFIGS / "demo.yaml").data.regenerate.speculative is None
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    speculative = load_config(CONFIGS / "demo.yaml", [f"data.regenerate.speculative={{draft: {tmp_path / 'draft'}}}"]
                              ).data.regenerate.speculative
    assert speculative.draft == str(tmp_path / "draft") and speculative.num_speculative_tokens == 3
    for value, message in [(tmp_path / "absent", r"data\.regenerate\.speculative: draft: .*absent is not a draft"),
                           (tmp_path, r"data\.regenerate\.speculative: draft: .* is not a draft folder \(no config")]:
        with pytest.raises(ConfigError, match=message) as raised:
            load_config(CONFIGS / "demo.yaml", [f"data.regenerate.speculative={{draft: {value}}}"])
        assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"data\.regenerate\.speculative\.num_speculative_tokens: .*greater than"):
        load_config(CONFIGS / "demo.yaml", [f"data.regenerate.speculative={{draft: {tmp_path / 'draft'}, "
                                            "num_speculative_tokens: 0}"])


def test_unreadable_and_non_yaml_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_dir: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+ not valid YAML"):
        load_config(bad)


def test_every_config_field_is_described():
    sections = {model for _, model in section_models(RunConfig)}
    undescribed = [f"{cls.__name__}.{name}" for cls in sections for name, field in cls.model_fields.items()
                   if not (field.description or "").strip()]
    assert len(sections) > 10 and undescribed == []
