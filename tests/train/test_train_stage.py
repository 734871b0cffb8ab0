"""Stage 04 end to end: exact resume, 2 processes = 1 process, and a demo draft that learns a real target."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from eagle3_pipeline import vocab
from eagle3_pipeline.config import load_config, parse_config
from eagle3_pipeline.stage_io import StageError, read_manifest
from eagle3_pipeline.stand_ins.fabricated_stages import write_data_stage, write_states_stage
from eagle3_pipeline.train import loop
from tests.conftest import CONFIGS, ROOT
from tests.train.fabricate import SMOLLM2_AUX_LAYER_IDS, smollm2_humaneval_inputs, tiny_run, tiny_run_config

LEARNED = ("loss_0", "acc_0", "loss_1", "acc_1", "loss_2", "acc_2")


def records(run_dir, split="train") -> dict[int, dict]:
    lines = (run_dir / "04_train" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == split}


def test_a_second_run_in_the_process_takes_another_precision():
    """accelerate's process-wide state refuses a second Accelerator of another precision (the tests train in-process
    under several configs): make_accelerator resets it."""
    for precision in ("bf16", "no", "bf16"):
        train = load_config(CONFIGS / "demo.yaml", [f"train.mixed_precision='{precision}'"]).train
        assert loop.make_accelerator(train).mixed_precision == precision


@pytest.mark.slow
@pytest.mark.parametrize("choices", [{}, {"optimizer": "muon", "standardize_aux": True, "freeze_lm_head": True}],
                         ids=["adamw", "muon-standardized-frozen-head"])
def test_resumed_run_equals_the_uninterrupted_run(tmp_path, capsys, choices):
    straight, _ = tiny_run(tmp_path, "straight", **choices)
    loop.run(straight)
    resumed, _ = tiny_run(tmp_path, "resumed", **choices)
    loop.run(resumed, stop_at_step=4)
    train_dir = resumed.run_dir / "04_train"
    assert read_manifest(train_dir) is None and (train_dir / "checkpoints" / "step_4").is_dir()
    assert sorted(p.name for p in (train_dir / "checkpoints").iterdir()) == ["step_3", "step_4"]
    with pytest.raises(StageError, match="holds checkpoints up to step_4 .* add --resume .* or --force"):
        loop.run(resumed)

    # resumed with other runtime knobs (a loader process, another checkpoint cadence): the same run carries on
    runtime_changed, _ = tiny_run_config(resumed.run_dir, tmp_path / "target", num_workers=1, checkpoint_every=5,
                                         **choices)
    loop.run(runtime_changed, resume=True)
    assert "resumed from" in capsys.readouterr().out
    want, got = records(straight.run_dir), records(resumed.run_dir)
    assert sorted(got) == sorted(want) == list(range(1, 7))
    for step in want:  # bit for bit: model, optimizer, schedule and data position were all restored
        assert {k: got[step][k] for k in (*LEARNED, "lr", "grad_norm")} == \
               {k: want[step][k] for k in (*LEARNED, "lr", "grad_norm")}, step
    final = "04_train/checkpoints/step_6/model.safetensors"
    a, b = load_file(str(straight.run_dir / final)), load_file(str(resumed.run_dir / final))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    first = load_file(str(straight.run_dir / "04_train/checkpoints/step_3/model.safetensors"))
    assert torch.equal(a["lm_head.weight"], first["lm_head.weight"]) == bool(choices.get("freeze_lm_head"))
    assert ("aux_scale" in a) == bool(choices.get("standardize_aux"))
    if "aux_scale" in a:  # measured on step 1's packs, then kept
        assert not torch.equal(a["aux_scale"], torch.ones_like(a["aux_scale"]))
        assert torch.equal(a["aux_scale"], first["aux_scale"])
    assert read_manifest(train_dir)["counts"]["eval_accuracy"] == read_manifest(
        straight.run_dir / "04_train")["counts"]["eval_accuracy"]

    loop.run(resumed, resume=True)  # finished: a no-op
    assert "already complete" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.parametrize("loss,chunk_rows", [("kl", None), ("tv", None), ("lk", 16), ("lk_alpha", 16)])
def test_each_loss_trains_the_draft(tmp_path, capsys, loss, chunk_rows):
    """A short run per `train.loss` (the plain path or the fused, chunked one): the trained loss is recorded
    under its name beside the KL, and falls on the eval split from eval to eval."""
    config, _ = tiny_run(tmp_path, loss=loss, loss_chunk_rows=chunk_rows, eval_every=2)
    loop.run(config)
    assert f"04_train: loss {loss} = " in capsys.readouterr().out
    key = "loss_0" if loss == "kl" else f"{loss}_0"
    train, evals = records(config.run_dir), records(config.run_dir, "eval")
    assert all({*LEARNED, key} <= record.keys() for record in [*train.values(), *evals.values()])
    assert all(math.isfinite(record[name]) for record in train.values() for name in (*LEARNED, key))
    curve = [evals[step][key] for step in sorted(evals)]
    print(f"{loss}: eval {key} at steps {sorted(evals)}: {curve}")
    assert sorted(evals) == [2, 4, 6] and curve[0] > curve[1] > curve[2] and train[6][key] < train[1][key]


@pytest.mark.slow
def test_two_processes_follow_the_one_process_curve(tmp_path):
    """With Muon, configs/kimi_k25.yaml's optimizer (the resume test below runs AdamW over processes)."""
    one, _ = tiny_run(tmp_path, "one", grad_accumulation=2, optimizer="muon")
    loop.run(one)
    two, two_yaml = tiny_run(tmp_path, "two", grad_accumulation=1, optimizer="muon")  # same global batch: 2 x 1 x 1
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "04_train.py", "--config", str(two_yaml)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2 process(es)" in result.stdout
    for split in ("train", "eval"):
        want, got = records(one.run_dir, split), records(two.run_dir, split)
        assert sorted(got) == sorted(want)
        for step in want:
            for key in LEARNED:
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-5), (split, step, key)


def torchrun_04(yaml_path, *args: str) -> subprocess.CompletedProcess:
    """04_train.py in 2 CPU processes (gloo)."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "04_train.py", "--config", str(yaml_path), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_a_checkpoint_resumes_under_another_number_of_processes(tmp_path, capsys):
    """2 processes -> 1 and 1 -> 2 at the same global batch (grad_accumulation 1 <-> 2) follow the straight run."""
    one, _ = tiny_run(tmp_path, "one", grad_accumulation=2)
    loop.run(one)  # the reference: 1 process x grad_accumulation 2, uninterrupted

    two_then_one, two_then_one_yaml = tiny_run(tmp_path, "two_then_one", grad_accumulation=1)
    torchrun_04(two_then_one_yaml, "--stop-at-step", "3")
    loop.run(load_config(two_then_one_yaml, ["train.grad_accumulation=2"]), resume=True)
    assert "written by 2 process(es) x micro_batch_size 1 x grad_accumulation 1" in capsys.readouterr().out

    one_then_two, one_then_two_yaml = tiny_run(tmp_path, "one_then_two", grad_accumulation=2)
    loop.run(one_then_two, stop_at_step=3)
    with pytest.raises(StageError, match="global batch of 2 packs per step, this launch has 3"):
        loop.run(load_config(one_then_two_yaml, ["train.grad_accumulation=3"]), resume=True)
    resumed = torchrun_04(one_then_two_yaml, "--resume", "--set", "train.grad_accumulation=1")  # rank 1: rank 0's RNG
    assert "resumed from" in resumed.stdout and "2 process(es)" in resumed.stdout

    for run in (two_then_one, one_then_two):
        assert read_manifest(run.run_dir / "04_train")["final_checkpoint"] == "checkpoints/step_6"
        for split in ("train", "eval"):
            want, got = records(one.run_dir, split), records(run.run_dir, split)
            assert sorted(got) == sorted(want)
            for step in want:
                for key in (*LEARNED, "lr") if split == "train" else LEARNED:
                    assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-5), (split, step, key)


@pytest.mark.slow
def test_demo_draft_learns_the_smollm2_target(tmp_path, smollm2_dir):
    """The demo's draft on real SmolLM2 hidden states (HumanEval chats): eval accuracy far above chance."""
    samples, states = smollm2_humaneval_inputs(smollm2_dir, 48)
    tree = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    tree["run_dir"] = str(tmp_path / "run")
    # 40 chats of ~187 tokens fill 15 packs of 512 rows: 24 steps are 1.6 epochs, about a minute here
    tree["train"] |= {"max_steps": 24, "packed_length": 512, "warmup_steps": 3, "eval_every": 12,
                      "checkpoint_every": 12, "log_every": 4}
    config = parse_config(tree, "demo.yaml")
    write_data_stage(config, samples[:40], samples[40:], vocab=49152)
    write_states_stage(config, states, SMOLLM2_AUX_LAYER_IDS)
    vocab.run(config)
    loop.run(config)

    train_dir = tmp_path / "run" / "04_train"
    manifest = read_manifest(train_dir)
    accuracy = manifest["counts"]["eval_accuracy"]
    print(f"demo eval accuracy per TTT step: {accuracy} (chance {1 / config.draft.draft_vocab_size:.5f})")
    assert accuracy[0] > 0.1 and min(accuracy) > 100 / config.draft.draft_vocab_size
    assert (train_dir / "curves.png").stat().st_size > 10_000 and any((train_dir / "tensorboard").iterdir())
    assert manifest["final_checkpoint"] == "checkpoints/step_24"
    assert (train_dir / manifest["final_checkpoint"] / "model.safetensors").is_file()
    # the simulated acceptance of the 8 held-out chats (acceptance.py), overall and for their one source
    simulated = manifest["counts"]["simulated_acceptance"]
    assert 1 < simulated["al_k3"] == simulated["al_k3/fabricated"] < 4
    assert simulated["al_k3_pos1"] >= simulated["al_k3_pos2"] >= simulated["al_k3_pos3"]
    assert simulated["al_k3"] == pytest.approx(1 + sum(simulated[f"al_k3_pos{i}"] for i in (1, 2, 3)))
    evals = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if r["split"] == "eval" and "al_k3" in r] == [12, 24]
