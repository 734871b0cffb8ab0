"""06's static check: a good export passes; each planted defect is named precisely and exits 1."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.export import stage as export
from eagle3_pipeline.export.format import read_spec, reference_spec
from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.validate import stage
from eagle3_pipeline.validate.compare import BREAKING, COSMETIC, OPTIONAL, check_vocab_maps, static_differences
from eagle3_pipeline.validate.weights_probe import left_at_init, skipped_parameters
from tests.conftest import run_python
from tests.subprocess_site import REFUSAL, without_speculators
from tests.validate.runs import trained_tiny_run


@pytest.fixture(scope="module")
def good_export(tmp_path_factory):
    """A trained tiny run exported (reference format), and the YAML file the scripts read."""
    config, path = trained_tiny_run(tmp_path_factory.mktemp("static"))
    export.run(config)
    return config, path, config.run_dir / "05_export" / "reference"


def planted(good, tmp_path, tensors=None, config=None):
    """A copy of the good export with `tensors(dict)` / `config(dict)` applied in place."""
    folder = tmp_path / "planted"
    shutil.copytree(good, folder)
    if tensors:
        state = load_file(str(folder / "model.safetensors"))
        tensors(state)
        save_file(state, str(folder / "model.safetensors"))
    if config:
        cfg = json.loads((folder / "config.json").read_text())
        config(cfg)
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def rename(state, old, new):
    state[new] = state.pop(old)


DEFECTS = {
    "renamed key": (
        {"tensors": lambda s: rename(s, "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.query.weight")},
        [("tensor midlayer.self_attn.q_proj.weight: missing [64, 128] bfloat16: vLLM leaves the parameter "
          "uninitialised; midlayer.self_attn.query.weight has its shape and dtype: renamed?"),
         "tensor midlayer.self_attn.query.weight: unexpected [64, 128] bfloat16"]),
    "transposed shape": (
        {"tensors": lambda s: s.update({"fc.weight": s["fc.weight"].t().contiguous()})},
        ["tensor fc.weight: shape [192, 64], expected [64, 192]: transposed"]),
    "float32 lm_head": (
        {"tensors": lambda s: s.update({"lm_head.weight": s["lm_head.weight"].float()})},
        ["tensor lm_head.weight: dtype float32, expected bfloat16"]),
    "missing d2t": (
        {"tensors": lambda s: s.pop("d2t")},
        ["tensor d2t: missing: vLLM keeps its draft-to-target map at zero"]),
    "d2t off by one": (
        {"tensors": lambda s: s.update({"d2t": s["d2t"] + 1})},
        ["d2t: d2t is off by +1 against t2d"]),
    "head_dim changed in config": (
        {"config": lambda c: c.update({"head_dim": 16})},
        ["config head_dim: 16, expected 32",
         ("tensor midlayer.self_attn.q_proj.weight: shape [64, 128] does not fit the export's own config.json, "
          "which implies [32, 128]")]),
    "aux ids shifted by one": (
        {"config": lambda c: c["eagle_config"].update({"eagle_aux_hidden_state_layer_ids": [2, 3, 4]})},
        [("config eagle_config.eagle_aux_hidden_state_layer_ids: [2, 3, 4], expected [1, 2, 3]: every id shifted "
          "by +1, another layer-id convention")]),
}


def test_good_export_passes(good_export):
    config, path, folder = good_export
    assert static_differences(folder, reference_spec(config), 2048) == []
    result = run_python("06_validate.py", "--config", str(path), "--check", str(folder))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "0 differences" in result.stdout


def test_static_check_of_both_formats_runs_without_speculators(good_export, tmp_path):
    """06 in vLLM 0.16's environment: the reference spec from the config, the speculators one from 05's manifest."""
    config, path, folder = good_export
    environment = without_speculators(tmp_path / "site")
    blocked = run_python("-c", "import speculators.models.eagle3", env=environment)
    assert blocked.returncode == 1 and REFUSAL in blocked.stderr
    assert config.export.formats == ["reference", "speculators"]
    for fmt in config.export.formats:
        result = run_python("06_validate.py", "--config", str(path), "--check", str(folder.parent / fmt), env=environment)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
        assert "0 differences" in result.stdout, fmt


@pytest.mark.parametrize("defect", DEFECTS)
def test_planted_defect_is_reported_as_breaking(good_export, tmp_path, capsys, defect):
    config, _, good = good_export
    change, messages = DEFECTS[defect]
    folder = planted(good, tmp_path, **change)
    with pytest.raises(StageError, match="breaking differences"):  # the scripts exit 1 on it
        stage.check(config, folder, None)
    table = capsys.readouterr().out
    for message in messages:
        where, _, text = message.partition(": ")
        assert f"| breaking | {where} | {text}" in table, (message, table)


def test_the_script_exits_1_on_a_breaking_difference(good_export, tmp_path):
    _, path, good = good_export
    folder = planted(good, tmp_path, tensors=lambda s: s.pop("d2t"))
    result = run_python("06_validate.py", "--config", str(path), "--check", str(folder))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: 1 breaking differences, first: tensor d2t: missing" in result.stderr


def test_cosmetic_and_optional_differences_pass(good_export, tmp_path):
    """speculators-style layers.0.* names, an embed_tokens copy, no t2d: vLLM loads it the same."""
    config, path, good = good_export

    def change(state):
        for name in [n for n in state if n.startswith("midlayer.")]:
            rename(state, name, name.replace("midlayer.", "layers.0."))
        state["embed_tokens.weight"] = torch.zeros(512, 64, dtype=torch.bfloat16)
        state.pop("t2d")

    folder = planted(good, tmp_path, tensors=change)
    kinds = {d.where: d.kind for d in static_differences(folder, reference_spec(config), 2048)}
    assert kinds["tensor layers.0.mlp.up_proj.weight"] == COSMETIC and kinds["tensor t2d"] == COSMETIC
    assert kinds["tensor embed_tokens.weight"] == OPTIONAL and BREAKING not in kinds.values()
    assert run_python("06_validate.py", "--config", str(path), "--check", str(folder)).returncode == 0


def test_against_a_reference_folder(good_export, tmp_path):
    """--reference compares with another checkpoint folder instead of the config's spec."""
    _, path, good = good_export
    other = planted(good, tmp_path, config=lambda c: c.pop("norm_before_residual"))
    result = run_python("06_validate.py", "--config", str(path), "--check", str(good), "--reference", str(other))
    assert result.returncode == 0 and "| cosmetic | config norm_before_residual | False, expected absent" in result.stdout
    assert read_spec(other).tensors == read_spec(good).tensors


def test_vocab_map_checks():
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[1, 4, 7]] = True
    d2t = torch.tensor([1, 3, 5])  # draft 0,1,2 -> target 1,4,7
    assert check_vocab_maps(d2t, t2d, 10) == []
    assert "outside the target vocab 0..9 (first: draft 2 -> target 10)" in \
        check_vocab_maps(torch.tensor([1, 3, 8]), t2d, 10)[0].message
    assert "not strictly increasing: draft 1 -> 4, draft 2 -> 3" in check_vocab_maps(torch.tensor([1, 3, 1]), t2d, 10)[0].message
    assert "d2t and t2d disagree: t2d keeps 3 ids" in check_vocab_maps(torch.tensor([1, 3, 6]), t2d, 10)[0].message


def test_skipped_parameters_from_a_load_record():
    report = {"loads": [{"received": ["fc.weight", "t2d", "lm_head.weight"],
                         "loaded": ["model.fc.weight", "lm_head.weight"],
                         "parameters": ["model.fc.weight", "lm_head.weight", "model.embed_tokens.weight",
                                        "model.layers.0.mlp.down_proj.weight"]}],
              "shared": ["model.embed_tokens.weight"]}
    assert skipped_parameters(report) == (["model.layers.0.mlp.down_proj.weight"], ["t2d"])
    # config.json asks for EAGLE 3.1's norms, but this vLLM built none: not loaded, so reported
    required = [f"model.fc_norm.{i}.weight" for i in range(2)]
    assert skipped_parameters(report, required)[0] == [*required, "model.layers.0.mlp.down_proj.weight"]
    assert skipped_parameters({"loads": [], "shared": []})[0][0].startswith("<no Eagle-3 draft was loaded")
    # vLLM 0.26 builds a draft-to-target map for every draft: a whole-vocabulary export leaves it at zeros, rightly
    report["loads"][0]["parameters"].append("draft_id_to_target_id")
    assert skipped_parameters(report)[0] == ["draft_id_to_target_id", "model.layers.0.mlp.down_proj.weight"]
    assert skipped_parameters(report, initialised=["draft_id_to_target_id"])[0] == [
        "model.layers.0.mlp.down_proj.weight"]


def test_only_a_whole_vocabulary_draft_leaves_vllms_map_at_its_initial_zeros():
    config = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 64, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 128, "vocab_size": 512,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5}
    assert left_at_init(config | {"draft_vocab_size": 512}) == ["draft_id_to_target_id"]
    assert left_at_init(config | {"draft_vocab_size": 128}) == []


def test_vllm_refusing_a_local_verifier_alone_is_optional_and_other_refusals_break(good_export, monkeypatch):
    """vLLM 0.34 serves a speculators folder alone only when its verifier is a Hub repository: the folder is
    still served as a draft (the serving command's form), so that refusal does not fail 06; any other does."""
    import vllm.transformers_utils.config as vllm_config

    from eagle3_pipeline.validate.compare import vllm_reads_speculators

    _, _, folder = good_export
    speculators = folder.parent / "speculators"
    assert vllm_reads_speculators(speculators) == []  # the installed vLLM reads it
    for message, kind in (("Speculators verifier must name a remote model repository. Select local verifiers "
                           "explicitly with --model and --speculative-config.", OPTIONAL),
                          ("unknown speculators algorithm", BREAKING)):
        def refuse(*args, message=message, **kwargs):
            raise ValueError(message)

        monkeypatch.setattr(vllm_config, "maybe_override_with_speculators", refuse)
        (difference,) = vllm_reads_speculators(speculators)
        assert difference.kind == kind, message
