"""Stage 05: reference-compatible folders from a trained checkpoint, and the Kimi spec from the config alone."""

from __future__ import annotations

import json
import shlex
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_pipeline.config import load_config
from eagle3_pipeline.export import stage as export
from eagle3_pipeline.export.format import (
    draft_fields,
    draft_tensor_shapes,
    dtype_name,
    export_dtype,
    read_spec,
    reference_spec,
    run_reference_config,
)
from eagle3_pipeline.export.stage import meta_draft, run_spec
from eagle3_pipeline.reference import REFERENCE_DRAFT_SPEC
from eagle3_pipeline.stage_io import StageError, read_manifest
from eagle3_pipeline.train import loop
from eagle3_pipeline.validate.compare import static_differences
from eagle3_pipeline.validate.stage import expected_spec
from tests.conftest import CONFIGS, run_python
from tests.train.fabricate import tiny_run
from tests.validate.runs import trained_tiny_run

REFERENCE = json.loads(REFERENCE_DRAFT_SPEC.read_text())
# Where `05_export.py --spec-only` on configs/kimi_k25.yaml departs from the reference spec, and why:
JUSTIFIED = {
    # the issue asks for it written out: vLLM reads an absent field as false for this format but as true
    # for the speculators format, so the explicit value removes the doubt (same semantics as the reference)
    "norm_before_residual": False,
}


EAGLE31 = ["draft.fc_norm=true", "draft.norm_output=true", "train.standardize_aux=false"]
# draft.attention mla, every size unlike transformers' DeepseekV3Config defaults: a size not passed on shows
MLA = ["draft.attention=mla", "draft.q_lora_rank=96", "draft.kv_lora_rank=48", "draft.qk_nope_head_dim=32",
       "draft.qk_rope_head_dim=16", "draft.v_head_dim=24", "export.formats=[reference]"]


def test_norm_knobs_reach_the_export_config_and_tensors():
    """speculators' norm options, off in the reference: when on, vLLM must read them from the export."""
    knobs = ["draft.norm_before_fc=true", "draft.norm_output=true", "train.standardize_aux=false"]
    config = load_config(CONFIGS / "tiny_kimi.yaml", knobs)
    aux_width = 3 * config.draft.hidden_size
    for fmt in ("reference", "speculators"):
        spec = run_spec(config, fmt)
        assert (spec.config["norm_before_fc"], spec.config["norm_output"]) == (True, True), fmt
        assert spec.tensors["input_norm.weight"] == {"shape": [aux_width], "dtype": "bfloat16"}, fmt
    draft, _, _ = draft_fields(run_spec(config, "reference").config)
    assert draft.norm_before_fc and draft.norm_output
    plain = run_spec(load_config(CONFIGS / "tiny_kimi.yaml"), "reference")  # the reference layout leaves them out
    assert not {"norm_before_fc", "fc_norm", "norm_output"} & plain.config.keys()
    assert not any("input_norm" in name or "fc_norm" in name for name in plain.tensors)


def test_eagle31_keys_and_tensors_in_both_formats():
    """EAGLE 3.1: the top-level keys vLLM reads (its speculators reader passes them on) and one norm per aux state."""
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    config = load_config(CONFIGS / "tiny_kimi.yaml", EAGLE31)
    for fmt in ("reference", "speculators"):
        spec = run_spec(config, fmt)
        assert (spec.config["fc_norm"], spec.config["norm_output"]) == (True, True), fmt
        assert {n: t for n, t in spec.tensors.items() if n.startswith("fc_norm.")} == {
            f"fc_norm.{i}.weight": {"shape": [config.draft.hidden_size], "dtype": "bfloat16"} for i in range(3)}, fmt
        assert draft_fields(spec.config)[0].fc_norm, fmt
    read = SpeculatorsConfig.extract_transformers_pre_trained_config(run_spec(config, "speculators").config)
    assert (read["fc_norm"], read["norm_output"], read["norm_before_fc"]) == (True, True, False)


@pytest.mark.parametrize("name, knobs", [
    ("kimi_k25", []), ("demo", []),
    ("tiny_kimi", ["draft.norm_before_fc=true", "draft.norm_output=true", "train.standardize_aux=false"]),
    ("tiny_kimi", EAGLE31), ("tiny_kimi", MLA), ("tiny_kimi", [*MLA, *EAGLE31]),
])
def test_the_tensors_a_config_implies_are_the_ones_training_builds(name, knobs):
    """06 computes the shapes from config.json alone; they must be what speculators' draft class builds."""
    config = load_config(CONFIGS / f"{name}.yaml", knobs)
    reference = run_reference_config(config)
    built = {n: (list(t.shape), dtype_name(export_dtype(t))) for n, t in meta_draft(reference).state_dict().items()}
    assert draft_tensor_shapes(reference) == built
    assert run_spec(config, "reference") == reference_spec(config)  # what 05 records is what 06 computes


def test_spec_only_kimi_equals_the_reference_except_the_listed_fields(tmp_path):
    out = tmp_path / "spec.json"
    result = run_python("05_export.py", "--config", str(CONFIGS / "kimi_k25.yaml"), "--spec-only", "--out", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    spec = json.loads(out.read_text())
    assert spec["tensors"] == {name: {"shape": t["shape"], "dtype": t["dtype"]} for name, t in REFERENCE["tensors"].items()}
    differing = {key for key in spec["config"].keys() | REFERENCE["config"].keys()
                 if spec["config"].get(key, "absent") != REFERENCE["config"].get(key, "absent")}
    assert differing == JUSTIFIED.keys()
    assert {key: spec["config"][key] for key in JUSTIFIED} == JUSTIFIED
    # and 06 classifies that one difference as cosmetic: exit 0
    result = run_python("06_validate.py", "--config", str(CONFIGS / "kimi_k25.yaml"), "--check", str(out),
                        "--reference", str(REFERENCE_DRAFT_SPEC))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "| cosmetic | config norm_before_residual |" in result.stdout


def test_spec_only_without_target_or_facts_is_a_config_error(tmp_path):
    result = run_python("05_export.py", "--config", str(CONFIGS / "kimi_k25.yaml"), "--spec-only",
                        "--out", str(tmp_path / "s.json"), "--set", "export.target_facts=null")
    assert result.returncode == 2
    assert "set export.target_facts" in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    config, path = trained_tiny_run(tmp_path_factory.mktemp("export"))
    export.run(config)
    return config, path


def test_reference_folder_matches_the_checkpoint_in_reference_names_and_dtypes(exported):
    config, _ = exported
    folder = config.run_dir / "05_export" / "reference"
    checkpoint = load_file(str(config.run_dir / "04_train" / "checkpoints" / "step_6" / "model.safetensors"))
    tensors = load_file(str(folder / "model.safetensors"))
    assert "embed_tokens.weight" not in tensors and not any(n.startswith("layers.") for n in tensors)
    for name, tensor in tensors.items():
        source = checkpoint[name.replace("midlayer.", "layers.0.", 1)]
        want = source.to(torch.bfloat16) if source.is_floating_point() else source
        assert tensor.dtype == want.dtype and torch.equal(tensor, want), name
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["head_dim"] == 32
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    assert cfg["norm_before_residual"] is False and cfg["draft_vocab_size"] == 128 and cfg["vocab_size"] == 512
    assert cfg["max_position_embeddings"] >= config.target.engine.max_model_len
    assert json.loads((folder / "spec.json").read_text()) == read_spec(folder).to_json()


def test_model_card_and_manifest(exported):
    config, _ = exported
    card = (config.run_dir / "05_export" / "reference" / "README.md").read_text()
    metrics = read_manifest(config.run_dir / "05_export")["eval_metrics"]
    assert metrics["step"] == 6 and len(metrics["eval_accuracy"]) == 3
    assert f"| 0 | {metrics['eval_accuracy'][0]:.4f} |" in card
    assert "checkpoint `step_6`" in card
    for fmt in ("reference", "speculators"):  # each card ends with its own folder's serving command
        folder = config.run_dir / "05_export" / fmt
        command = export.serving_command(config, folder)
        assert f"## Serving\n```\n{command}\n```" in (folder / "README.md").read_text()
        # either format: the target, with the folder as its draft (vLLM 0.34 serves a speculators folder alone
        # only when its verifier is a Hub repository)
        words = shlex.split(command)
        assert config.target.path in words
        speculative = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3}
        assert json.loads(words[words.index("--speculative-config") + 1]) == speculative
    with safe_open(str(config.run_dir / "05_export" / "speculators" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "layers.0.self_attn.q_proj.weight" in names and "embed_tokens.weight" not in names


def test_vllm_reads_the_speculators_folder_as_eagle3_on_the_target(exported):
    from vllm.transformers_utils.config import maybe_override_with_speculators
    from vllm.transformers_utils.configs.speculators.base import SpeculatorsConfig

    config, _ = exported
    folder = config.run_dir / "05_export" / "speculators"
    model, _, speculative = maybe_override_with_speculators(str(folder), None, trust_remote_code=False)
    assert model == config.target.path
    assert speculative == {"method": "eagle3", "num_speculative_tokens": 3, "model": str(folder)}
    draft = SpeculatorsConfig.extract_transformers_pre_trained_config(json.loads((folder / "config.json").read_text()))
    assert draft["architectures"] == ["Eagle3LlamaForCausalLM"] and draft["norm_before_residual"] is False
    assert draft["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3] and draft["head_dim"] == 32


def test_checkpoint_choice(exported):
    config, _ = exported
    with pytest.raises(StageError, match=r"holds the export of 04_train/checkpoints/step_6; add --force .* step_3"):
        export.run(config, checkpoint="step_3")
    with pytest.raises(StageError, match=r"--checkpoint 9: not in .* \(have: step_3, step_6\)"):
        export.run(config, checkpoint="9", force=True)
    export.run(config, checkpoint="3", force=True)
    assert read_manifest(config.run_dir / "05_export")["checkpoint"] == "04_train/checkpoints/step_3"
    export.run(config, force=True)  # back to the last checkpoint for the other tests


def test_checkpoint_of_another_draft_shape_is_refused(exported, tmp_path):
    config, _ = exported
    state = load_file(str(config.run_dir / "04_train" / "checkpoints" / "step_6" / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"][:, :10].contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    reference = json.loads((config.run_dir / "05_export" / "reference" / "config.json").read_text())
    with pytest.raises(StageError, match=r"does not fit the `draft:` config .* fc.weight \[64, 10\] != \[64, 192\]"):
        export.load_checkpoint_state(tmp_path, reference)


def test_eagle31_export_round_trip_and_static_check(tmp_path):
    """A draft trained with fc_norm + norm_output: both folders hold the checkpoint's fc_norm tensors and the 3.1
    keys, 06's static check passes them, and names an fc_norm tensor deleted from the export."""
    config, path = tiny_run(tmp_path, draft={"fc_norm": True, "norm_output": True}, standardize_aux=False)
    loop.run(config)
    export.run(config)
    checkpoint = load_file(str(config.run_dir / "04_train" / "checkpoints" / "step_6" / "model.safetensors"))
    manifest = read_manifest(config.run_dir / "05_export")
    for fmt in ("reference", "speculators"):
        folder = config.run_dir / "05_export" / fmt
        tensors = load_file(str(folder / "model.safetensors"))
        for i in range(3):
            name = f"fc_norm.{i}.weight"
            assert torch.equal(tensors[name], checkpoint[name].to(torch.bfloat16)), (fmt, name)
        assert not torch.equal(tensors["fc_norm.0.weight"], torch.ones_like(tensors["fc_norm.0.weight"]))  # trained
        cfg = json.loads((folder / "config.json").read_text())
        assert (cfg["fc_norm"], cfg["norm_output"]) == (True, True), fmt
        assert static_differences(folder, expected_spec(config, fmt, manifest), 2048) == [], fmt
    broken = tmp_path / "broken"
    shutil.copytree(config.run_dir / "05_export" / "reference", broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["fc_norm.2.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    result = run_python("06_validate.py", "--config", str(path), "--check", str(broken))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert ("| breaking | tensor fc_norm.2.weight | missing [64] bfloat16: vLLM does not check it and runs the norm "
            "with its initial weight of ones |") in result.stdout


def test_a_draft_over_the_whole_vocabulary_exports_without_vocab_maps(tmp_path):
    """draft.draft_vocab_size = the target's vocabulary: 03's map is the identity, speculators' draft holds no maps,
    and neither folder stores d2t or t2d (vLLM builds no map for an equal vocabulary and its loader refuses a d2t
    there); 06's static check passes both, and names a d2t put back."""
    from eagle3_pipeline.vocab import load_draft_vocab
    from tests.train.fabricate import TINY

    config, path = tiny_run(tmp_path, draft={"draft_vocab_size": TINY["vocab"]})
    d2t, t2d = load_draft_vocab(config.run_dir / "03_vocab")
    assert not d2t.any() and t2d.all()
    loop.run(config)
    export.run(config)
    manifest = read_manifest(config.run_dir / "05_export")
    for fmt in ("reference", "speculators"):
        folder = config.run_dir / "05_export" / fmt
        tensors = load_file(str(folder / "model.safetensors"))
        assert not {"d2t", "t2d"} & set(tensors) and tensors["lm_head.weight"].shape[0] == TINY["vocab"], fmt
        assert static_differences(folder, expected_spec(config, fmt, manifest), 2048) == [], fmt
    broken = tmp_path / "broken"
    shutil.copytree(config.run_dir / "05_export" / "reference", broken)
    tensors = load_file(str(broken / "model.safetensors")) | {"d2t": torch.zeros(TINY["vocab"], dtype=torch.int64),
                                                              "t2d": torch.ones(TINY["vocab"], dtype=torch.bool)}
    save_file(tensors, str(broken / "model.safetensors"))
    result = run_python("06_validate.py", "--config", str(path), "--check", str(broken))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert ("| breaking | tensor d2t | unexpected [512] int64: the draft predicts the target's whole vocabulary, "
            "where vLLM builds no draft-to-target map, and its loader refuses this tensor |") in result.stdout
    assert "| cosmetic | tensor t2d | present: vLLM skips t2d when it loads |" in result.stdout
