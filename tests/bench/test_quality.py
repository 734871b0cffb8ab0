"""bench/quality.py's CPU-cheap parts: our 01/02 in speculators' offline-data format, read back by its own
dataset class, the token-budget match, and the report's figures recomputed from a saved result's runs (no
training, no vLLM)."""

from __future__ import annotations

import argparse
import json

import datasets
import torch

from bench import quality
from bench.harness import spread
from bench.quality import identical_outputs, matched_steps, summarize, work_seconds
from bench.speculators_trainer import train_batches, write_dataset
from tests.conftest import ROOT
from tests.train.fabricate import TINY, tiny_run


def test_our_data_reads_back_through_speculators_dataset(tmp_path):
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.data import ArrowDataset

    config, _ = tiny_run(tmp_path)
    facts = write_dataset(config.run_dir, tmp_path / "spec")
    assert (facts["train_rows"], facts["eval_rows"]) == (24, 6)
    train = ArrowDataset(max_len=512, datapath=tmp_path / "spec", on_missing="raise",
                         train_ratio=facts["train_data_ratio"], split="train")
    val = ArrowDataset(max_len=512, datapath=tmp_path / "spec", on_missing="raise",
                       train_ratio=facts["train_data_ratio"], split="val")
    assert (len(train), len(val)) == (24, 6)  # its split boundary falls exactly on ours

    ours = datasets.load_from_disk(str(config.run_dir / "01_data" / "eval"))[0]
    sample = val[0]
    assert sample["input_ids"].tolist() == ours["input_ids"]
    assert sample["loss_mask"].tolist() == ours["loss_mask"]
    n_aux = len(TINY["aux_layer_ids"])
    assert sample["hidden_states"].shape == (len(ours["input_ids"]), n_aux * TINY["hidden"])
    assert sample["verifier_last_hidden_states"].shape == (len(ours["input_ids"]), TINY["hidden"])

    from eagle3_pipeline.capture.store import open_reader

    reader, _ = open_reader(config.run_dir / "02_hidden_states")
    aux, final = reader.get(ours["id"])
    assert torch.equal(sample["hidden_states"], aux.flatten(1))
    assert torch.equal(sample["verifier_last_hidden_states"], final)
    shifted = shift_batch(sample)  # speculators' row t = token t+1, states t: the rows our 04 builds
    assert shifted["input_ids"].shape[0] == len(ours["input_ids"]) - 1


def test_token_budget_match(tmp_path):
    config, _ = tiny_run(tmp_path)
    facts = write_dataset(config.run_dir, tmp_path / "spec")
    rows = train_batches(tmp_path / "spec", 256, facts["train_data_ratio"], seed=0, epochs=3)
    per_epoch = train_batches(tmp_path / "spec", 256, facts["train_data_ratio"], seed=0, epochs=1)
    assert sum(per_epoch) == sum(len(s) - 1 for s in datasets.load_from_disk(str(config.run_dir / "01_data" / "train"))["input_ids"])
    steps, tokens = matched_steps(rows, 2 * sum(per_epoch))
    assert tokens == sum(rows[:steps]) and abs(tokens - 2 * sum(per_epoch)) <= max(rows)
    assert spread([1.0, 3.0])["mean"] == 2.0


def test_reuse_01_copies_the_finished_01_data_before_the_stages_run(tmp_path, monkeypatch):
    """`--reuse-01` (bench/quality.py, bench/quality_gpu.py): the earlier 01_data is in place before 01 runs, so
    01 finds itself complete; its seconds come from that run's manifest."""
    earlier = tmp_path / "earlier" / "01_data"
    earlier.mkdir(parents=True)
    (earlier / "manifest.json").write_text('{"timings_s": {"total": 569.0}}')
    shared = tmp_path / "shared"
    seen = []

    def stage_ran(command, log):  # each stage: what it found, and a manifest as a finished stage leaves one
        script = next(word for word in command if word.endswith(".py"))
        seen.append((script, (shared / "01_data" / "manifest.json").exists()))
        stage = shared / {"01": "01_data", "02": "02_hidden_states", "03": "03_vocab"}[script[:2]]
        stage.mkdir(parents=True, exist_ok=True)
        if not (stage / "manifest.json").exists():
            (stage / "manifest.json").write_text('{"timings_s": {"total": 1.0}}')
        return 0.5

    monkeypatch.setattr(quality, "run_logged", stage_ran)
    args = argparse.Namespace(reuse_01=earlier, config=tmp_path / "unused.yaml")
    seconds = quality.shared_stages(args, quality.Clock(), shared)
    assert seen[0] == ("01_prepare_data.py", True)
    assert seconds["01_prepare_data.py"] == 569.0 and seconds["02_generate_hidden_states.py"] == 1.0


def test_a_saved_results_figures_are_what_its_runs_give():
    report = json.loads((ROOT / "bench" / "results" / "quality.json").read_text())
    assert summarize(report["runs"], report["ks"]) == report["results"]
    eval_s = report["wall_time_s"].get("shared teacher-forced eval", 0.0)
    assert work_seconds(report["work_s"]["stages_01_03"], report["runs"], eval_s) == report["work_s"]
    runs = [{"trainer": "a", "seed": 0, "serve": {"3": {"outputs": [1, 2]}}},
            {"trainer": "b", "seed": 0, "serve": {"3": {"outputs": [1, 3]}, "5": {"outputs": [1, 2]}}}]
    assert identical_outputs(runs, [3, 5]) == {"a_seed0_k3": 1.0, "b_seed0_k3": 0.5, "b_seed0_k5": 1.0}
