"""Valid but unusual runs through the stages' command lines, on both stand-in targets, regeneration off.

Every stage ends with exit 0, or with one error line and the contract's exit code (2 config or usage,
1 failure), never a traceback. Cheap by construction: a stage that starts no engine runs in this process
(its script through `runpy`, so the command line and the exit-code mapping are the real ones); each target
gets one vLLM capture, and the cases that change only later stages share it (on a copy of the run folder
when a case leaves a stage's folder in another state).
"""

from __future__ import annotations

import json
import runpy
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import datasets
import pytest
import torch
import yaml

from eagle3_pipeline.capture.store import open_reader
from eagle3_pipeline.config import load_config
from eagle3_pipeline.stage_io import read_manifest
from eagle3_pipeline.stand_ins.fabricated_stages import write_data_stage
from tests.conftest import CONFIGS, ROOT

CHAT = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "2 + 2 = 4."}]
OFF = ["data.regenerate.enabled=false", "data.eval_sources=[]", "data.eval_fraction=0"]
SHORT_TRAINING = ["train.max_steps=2", "train.warmup_steps=1", "train.log_every=1", "train.eval_every=1",
                  "train.checkpoint_every=2"]


@dataclass
class Exit:
    code: int
    out: str
    err: str

    def error_line(self) -> str:
        """The one line a failed stage ends with (no traceback, nothing after it)."""
        assert "Traceback" not in self.err, self.err[-3000:]
        lines = self.err.strip().splitlines()
        errors = [line for line in lines if line.startswith(("error: ", "config error: "))]
        assert errors == lines[-1:], self.err[-3000:]
        return errors[0]


def config_file(folder: Path, name: str, sets: list[str]) -> Path:
    """configs/<name>.yaml resolved with `sets` (run_dir: folder/run), written as folder/<name>.yaml."""
    config = load_config(CONFIGS / f"{name}.yaml", [f"run_dir={folder / 'run'}", *sets])
    path = folder / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False))
    return path


def stage(capsys, script: str, config: Path, *args: str) -> Exit:
    """`python SCRIPT --config CONFIG ARGS`, run in this process."""
    capsys.readouterr()
    with mock.patch.object(sys, "argv", [script, "--config", str(config), *args]):
        try:
            runpy.run_path(str(ROOT / script), run_name="__main__")
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    captured = capsys.readouterr()
    return Exit(code, captured.out, captured.err)


def capture(config: Path, *args: str) -> Exit:
    """02 in its own process: it starts vLLM."""
    result = subprocess.run([sys.executable, "02_generate_hidden_states.py", "--config", str(config), *args],
                            cwd=ROOT, capture_output=True, text=True, timeout=900)
    return Exit(result.returncode, result.stdout, result.stderr)


def ok(result: Exit) -> Exit:
    assert result.code == 0 and "Traceback" not in result.err, result.out[-2000:] + result.err[-3000:]
    return result


def copy_run(config: Path, folder: Path, stages: tuple[str, ...]) -> Path:
    """A second run folder holding copies of `stages` (stage identity never includes run_dir)."""
    tree = yaml.safe_load(config.read_text())
    for name in stages:
        shutil.copytree(Path(tree["run_dir"]) / name, folder / "run" / name)
    tree["run_dir"] = str(folder / "run")
    path = folder / config.name
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def sets(*items: str) -> list[str]:
    return [arg for item in items for arg in ("--set", item)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ------------------------------------------------------------------------------ 01 only, both targets
@pytest.mark.parametrize("target", ["demo", "tiny_kimi"])
def test_samples_cut_to_their_prompt_leave_01_nothing_to_train(tmp_path, capsys, target):
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}] * 2)
    config = config_file(tmp_path, target, [*OFF, f"data.sources=[{{kind: file, name: {data}}}]",
                                            "data.max_seq_len=16"])
    result = stage(capsys, "01_prepare_data.py", config)
    assert result.code == 1
    assert result.error_line() == "error: no valid training samples (no_loss_tokens 2 (first: chats-0))"


@pytest.mark.parametrize("target", ["demo", "tiny_kimi"])
def test_a_run_without_eval_prompts_writes_an_empty_readable_eval_split(tmp_path, capsys, target):
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}])
    config = config_file(tmp_path, target, [*OFF, f"data.sources=[{{kind: file, name: {data}}}]"])
    result = ok(stage(capsys, "01_prepare_data.py", config))
    assert "warning: the eval split is empty" in result.out
    data_dir = tmp_path / "run" / "01_data"
    assert len(datasets.load_from_disk(str(data_dir / "eval"))) == 0
    assert len(datasets.load_from_disk(str(data_dir / "train"))) == 1


def test_02_and_03_refuse_what_the_target_cannot_serve_before_they_begin(tmp_path, capsys):
    """An aux id past the last layer, a sample that fills the engine's context, a draft vocab larger than the
    target's: exit 2 before any engine starts, and no stage folder left that the corrected config would have
    to --force."""
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHAT}])
    config = config_file(tmp_path, "demo", [*OFF, f"data.sources=[{{kind: file, name: {data}}}]",
                                            "target.engine.max_model_len=32"])
    ok(stage(capsys, "01_prepare_data.py", config))
    longest = datasets.load_from_disk(str(tmp_path / "run" / "01_data" / "train"))["seq_len"][0]
    assert longest >= 32

    past_last = stage(capsys, "02_generate_hidden_states.py", config, *sets("capture.aux_layer_ids=[2, 15, 30]"))
    assert past_last.code == 2
    assert past_last.error_line() == \
        "config error: capture.aux_layer_ids [2, 15, 30]: the target has 30 layers (ids 0..29)"
    too_long = stage(capsys, "02_generate_hidden_states.py", config)
    assert too_long.code == 2
    assert too_long.error_line().startswith(
        f"config error: target.engine.max_model_len 32 leaves no room for the longest sample of 01_data ({longest} "
        f"tokens) and one generated token: raise it to {longest + 1}")
    assert not (tmp_path / "run" / "02_hidden_states").exists()

    too_large = stage(capsys, "03_build_vocab_map.py", config, *sets("draft.draft_vocab_size=50000"))
    assert too_large.code == 2
    assert too_large.error_line() == "config error: draft.draft_vocab_size 50000 exceeds the target vocabulary (49152)"
    assert not (tmp_path / "run" / "03_vocab").exists()


# ------------------------------------------------ demo: one training sample, no eval split, 01 -> 06
@pytest.mark.vllm
def test_demo_one_sample_no_eval_runs_through_05_and_06_says_what_to_configure(tmp_path, capsys):
    """One training sample and no eval split; 02 split over more jobs than samples, the last aux layer among its
    layers; 03 with a draft vocab far larger than the distinct loss tokens; 04 with a global batch of more packs
    than the data has, and with a sample longer than its packed_length."""
    data = write_jsonl(tmp_path / "one.jsonl", [{"messages": CHAT}])
    config = config_file(tmp_path / "a", "demo", [
        *OFF, *SHORT_TRAINING, f"data.sources=[{{kind: file, name: {data}}}]",
        "capture.aux_layer_ids=[2, 15, 29]",  # 29: the residual stream entering SmolLM2's last layer
        "train.packed_length=128", "train.grad_accumulation=3"])
    ok(stage(capsys, "01_prepare_data.py", config))

    for job in (2, 1):  # jobs without a shard finish at once, before the one that captures
        idle = ok(stage(capsys, "02_generate_hidden_states.py", config, "--shard-index", str(job), "--num-shards", "3"))
        assert f"0 for job {job}/3" in idle.out and "shards of other jobs still missing" in idle.out
    ok(capture(config, "--shard-index", "0", "--num-shards", "3"))
    reader, layout = open_reader(tmp_path / "a" / "run" / "02_hidden_states")
    assert layout.aux_layer_ids == [2, 15, 29] and list(reader.index) == ["one-0"]

    vocab = ok(stage(capsys, "03_build_vocab_map.py", config))
    assert "keeping 4096 of 49152; coverage 100.00%" in vocab.out
    too_short = copy_run(config, tmp_path / "b", ("01_data", "02_hidden_states", "03_vocab"))

    trained = ok(stage(capsys, "04_train.py", config))
    assert "1 train samples" in trained.out and "0 eval packs" in trained.out and "global batch 3 packs" in trained.out
    assert read_manifest(tmp_path / "a" / "run" / "04_train")["counts"]["eval_accuracy"] is None
    exported = ok(stage(capsys, "05_export.py", config))
    card = (tmp_path / "a" / "run" / "05_export" / "reference" / "README.md").read_text()
    assert "no eval record at this checkpoint" in card, exported.out
    validated = stage(capsys, "06_validate.py", config)
    assert validated.code == 1
    assert validated.error_line().startswith("error: 01_data has no eval prompts")
    assert "data.eval_sources" in validated.error_line() and "data.eval_fraction" in validated.error_line()

    refused = stage(capsys, "04_train.py", too_short, *sets("train.packed_length=16"))
    assert refused.code == 2
    assert refused.error_line().startswith("config error: train.packed_length 16 is shorter than the longest sample")
    assert not (tmp_path / "b" / "run" / "04_train").exists()  # nothing the corrected config would have to --force


# --------------------------------------------- tiny Kimi: fp8 capture with a one-token sample, 01 -> 05
@pytest.mark.vllm
def test_tiny_kimi_fp8_capture_of_a_one_token_sample_trains_and_exports(tmp_path, capsys, tiny_kimi_dir):
    """A fabricated 01 (no template makes a one-token sample), the last layer as an aux layer, fp8 states."""
    from transformers import AutoTokenizer

    config = config_file(tmp_path, "tiny_kimi", [*SHORT_TRAINING, "capture.dtype=fp8",
                                                 "capture.aux_layer_ids=[2, 4, 7]"])  # 7: the last of 8 layers
    tokenizer = AutoTokenizer.from_pretrained(tiny_kimi_dir)
    prompt = tokenizer.apply_chat_template(CHAT[:1], add_generation_prompt=True, return_dict=False)
    answer = tokenizer.encode(CHAT[1]["content"], add_special_tokens=False)
    chat = {"input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)}
    samples = [{"id": "one-token", "input_ids": answer[:1], "loss_mask": [1]}, {"id": "chat", **chat},
               {"id": "eval-chat", **chat}]
    write_data_stage(load_config(config), samples[:2], samples[2:], vocab=163840)

    ok(capture(config))
    reader, layout = open_reader(tmp_path / "run" / "02_hidden_states")
    aux, final = reader.get("one-token")
    assert layout.dtype == "fp8" and aux.shape == (1, 3, 256) and final.shape == (1, 256)
    assert torch.isfinite(aux.float()).all() and torch.isfinite(final.float()).all()
    ok(stage(capsys, "03_build_vocab_map.py", config))
    trained = ok(stage(capsys, "04_train.py", config))
    assert "2 train samples" in trained.out
    ok(stage(capsys, "05_export.py", config))
