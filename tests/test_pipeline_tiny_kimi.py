"""01 ... 06 run as a user runs them, one script after the other, on configs/tiny_kimi.yaml: the Kimi code paths
end to end, through Kimi's remote-code tiktoken tokenizer (trust_remote_code in 01, 02 and 06). 01 lets the
MLA target write magpie chats in thinking mode and answer a conversation holding two images (a file and a
data URL); 02 captures through the worker extension (MLA), the images' tokens through the MoonViT tower;
03, 04 (4 steps), 05 (both formats); 06 checks both folders and serves the reference draft on the MLA
target, in an environment where speculators cannot be imported (as vLLM 0.16's).

Then 04-06 again from the same 01-03 with an MLA draft (draft.attention mla), served by vLLM's own MLA draft
class on the MLA target. Four engine starts (01, 02, 06 twice): a few minutes on 2 cores.
"""

from __future__ import annotations

import json
import shutil

import pytest
from datasets import load_from_disk

from eagle3_pipeline.capture.store import open_reader
from eagle3_pipeline.config import load_config
from eagle3_pipeline.data.dataset import read_stats
from eagle3_pipeline.stage_io import STAGES, read_manifest
from eagle3_pipeline.stand_ins.tiny_kimi import write_image_chat
from tests.conftest import CONFIGS, run_python
from tests.stage_reads import check_fingerprints_cover_reads
from tests.subprocess_site import python_environment

THINK = 163606  # Kimi's <think>: in thinking mode the generation prompt opens the reasoning
MEDIA_PAD = 163605  # Kimi's image placeholder: vLLM makes one per 2x2 merged 14-pixel patches of an image
MLA_DRAFT = ["draft.attention=mla", "draft.q_lora_rank=64", "draft.kv_lora_rank=512", "draft.qk_nope_head_dim=64",
             "draft.qk_rope_head_dim=64", "draft.v_head_dim=64", "export.formats=[reference]"]
SETTINGS = ["train.max_steps=4", "train.warmup_steps=1", "train.checkpoint_every=4", "train.eval_every=4",
            "train.log_every=1", "validate.compare_without_speculation=false",
            "data.regenerate.max_tokens=16", "target.engine.max_num_seqs=48"]  # 01 in one round of short answers


@pytest.mark.vllm
def test_the_numbered_scripts_run_the_tiny_kimi_from_chats_to_served_draft(tmp_path):
    run_dir = tmp_path / "run"
    sources = f"data.sources=[{{kind: magpie, limit: 32, max_tokens: 8}}, {{kind: file, name: {write_image_chat(tmp_path)}}}]"
    overrides = [word for setting in [f"run_dir={run_dir}", sources, *SETTINGS] for word in ("--set", setting)]
    manifests, outputs = {}, {}
    reads_dir = tmp_path / "config_reads"  # each script records the config keys it reads (tests/read_recorder.py)
    for spec in STAGES.values():
        environment = python_environment(tmp_path / spec.name, no_speculators=spec.name == "06_validate",
                                         reads_dir=reads_dir)
        result = run_python(spec.script, "--config", str(CONFIGS / "tiny_kimi.yaml"), *overrides, timeout=900,
                            env=environment)
        assert result.returncode == 0, f"{spec.script}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        manifests[spec.name], outputs[spec.name] = read_manifest(run_dir / spec.name), result.stdout
        assert manifests[spec.name] is not None and manifests[spec.name]["stage"] == spec.name

    assert "capture path: worker_extension" in outputs["02_hidden_states"]  # the image chat needs the vision tower
    assert ", text only" not in outputs["02_hidden_states"]
    data = manifests["01_data"]["counts"]
    stats = read_stats(run_dir / "01_data")
    assert data["train_samples"] + data["eval_samples"] + data["skipped"] == 33 and data["eval_samples"] >= 1
    assert stats["generation"]["answers_generated"] > 0
    prompts = load_from_disk(str(run_dir / "01_data" / "eval"))["prompt_ids"]
    assert all(ids[-1] == THINK for ids in prompts), "the eval prompts must end in the thinking-mode opening"
    # The image chat (held for training by eval_fraction's seed): its placeholders expanded, never trained.
    train = load_from_disk(str(run_dir / "01_data" / "train"))
    (row,) = [r for r in train if r["id"] == "pictures-0"]
    image_rows = [i for i, token in enumerate(row["input_ids"]) if token == MEDIA_PAD]
    assert len(row["images"]) == 2 and stats["train"]["image_tokens"] == len(image_rows) > 2
    assert not any(row["loss_mask"][i] for i in image_rows) and any(row["loss_mask"])

    states = manifests["02_hidden_states"]
    assert "capture path: worker_extension" in outputs["02_hidden_states"]
    assert states["layout"]["aux_layer_ids"] == [2, 4, 5] and states["layout"]["final_layer_id"] == 8
    assert states["counts"]["samples"] == data["train_samples"] + data["eval_samples"]
    # 02 checked that vLLM's expanded prompt is 01's ids; the captured rows are as many
    aux, final = open_reader(run_dir / "02_hidden_states")[0].get("pictures-0")
    assert aux.shape[0] == final.shape[0] == len(row["input_ids"])

    assert manifests["03_vocab"]["counts"]["draft_vocab_size"] == 2048
    assert manifests["04_train"]["counts"]["steps"] == 4 and manifests["04_train"]["counts"]["eval_accuracy"]
    assert manifests["05_export"]["formats"] == ["reference", "speculators"]
    assert set(manifests["05_export"]["specs"]) == {"reference", "speculators"}

    report = json.loads((run_dir / "06_validate" / "report.json").read_text())
    assert report["verdict"] == "PASSED" and report["prompts"] == min(4, data["eval_samples"])
    assert report["runs"][0]["num_drafts"] > 0 and report["runs"][0]["skipped_parameters"] == []
    assert all(d["kind"] != "breaking" for ds in report["static_differences"].values() for d in ds)
    assert manifests["06_validate"]["counts"]["prompts"] == report["prompts"]

    # Fingerprints from reads: every key a stage read makes it stale when changed.
    config = load_config(CONFIGS / "tiny_kimi.yaml", [overrides[i + 1] for i in range(0, len(overrides), 2)])
    changed = check_fingerprints_cover_reads(config, reads_dir)
    print(f"config keys read and changed per stage: {changed}")

    # The same run's 01-03 with an MLA draft (draft.attention mla, at the latent width vLLM CPU's MLA kernels
    # take): 04-06 again; vLLM serves it on the MLA target with its Eagle3DeepseekV2ForCausalLM, every tensor loaded.
    mla_dir = tmp_path / "mla-run"
    for name in ("01_data", "02_hidden_states", "03_vocab"):
        shutil.copytree(run_dir / name, mla_dir / name)
    mla = [word for setting in [f"run_dir={mla_dir}", sources, *SETTINGS, *MLA_DRAFT] for word in ("--set", setting)]
    for spec in list(STAGES.values())[3:]:
        result = run_python(spec.script, "--config", str(CONFIGS / "tiny_kimi.yaml"), *mla, timeout=900)
        assert result.returncode == 0, f"{spec.script} (mla):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    report = json.loads((mla_dir / "06_validate" / "report.json").read_text())
    run = report["runs"][0]
    assert report["verdict"] == "PASSED" and run["num_drafts"] > 0 and run["skipped_parameters"] == []
    assert "model.layers.0.self_attn.fused_qkv_a_proj.weight" in run["loaded_parameters"]
    assert json.loads((mla_dir / "05_export" / "reference" / "config.json").read_text())["architectures"] == [
        "Eagle3DeepseekV2ForCausalLM"]
