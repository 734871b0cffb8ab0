"""Stage 02 on the SmolLM2 stand-in, through its command line: states equal HF transformers' hidden states;
a killed run resumes to the same tensors; two shard jobs give the unsharded result; fp8 halves the disk."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from eagle3_pipeline.capture.store import open_reader
from eagle3_pipeline.config import load_config
from tests.conftest import CONFIGS, ROOT, fabricate_prepared_data

pytestmark = pytest.mark.vllm

CHATS = {
    "train": [
        [{"role": "user", "content": "What is the capital of France?"},
         {"role": "assistant", "content": "The capital of France is Paris."}],
        [{"role": "user", "content": "Write a haiku about autumn."},
         {"role": "assistant", "content": "Crisp leaves drift and fall,\nred and gold on quiet paths,\nthe year exhales slow."}],
        [{"role": "user", "content": "What is 12 * 7?"}, {"role": "assistant", "content": "12 * 7 = 84."}],
        [{"role": "user", "content": "Name a prime number above 100."}, {"role": "assistant", "content": "101 is prime."}],
        [{"role": "user", "content": "Reverse a list in Python."},
         {"role": "assistant", "content": "Use `items[::-1]` for a copy or `items.reverse()` in place."}],
    ],
    "eval": [
        [{"role": "user", "content": "Explain recursion in one sentence."},
         {"role": "assistant", "content": "Recursion is when a function solves a problem by calling itself on smaller parts."}],
        [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}],
    ],
}
SETTINGS = ["capture.samples_per_shard=2", "capture.batch_size=2"]  # 7 samples -> 4 shards


def overrides(run_dir: Path, *extra: str) -> list[str]:
    return [f"run_dir={run_dir}", *SETTINGS, *extra]


def capture_command(run_dir: Path, *args: str, sets: tuple[str, ...] = ()) -> list[str]:
    command = [sys.executable, "02_generate_hidden_states.py", "--config", str(run_dir / "demo.yaml"), *args]
    for item in overrides(run_dir, *sets):
        command += ["--set", item]
    return command


def run_capture(run_dir: Path, *args: str, sets: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    result = subprocess.run(capture_command(run_dir, *args, sets=sets), cwd=ROOT, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result


def new_run_dir(prepared: Path, name: str) -> Path:
    """A run folder whose 01_data and config are copies of the prepared ones (01's identity included)."""
    run_dir = prepared.parent / "runs" / name
    shutil.copytree(prepared / "01_data", run_dir / "01_data")
    shutil.copy(prepared / "demo.yaml", run_dir / "demo.yaml")
    return run_dir


def all_states(run_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    reader, _ = open_reader(run_dir / "02_hidden_states")
    return {sample_id: reader.get(sample_id) for sample_id in reader.index}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory, smollm2_dir) -> Path:
    """A finished 01_data, and the config every run of this module uses (a copy: fixed for the module)."""
    run_dir = tmp_path_factory.getbasetemp() / "prepared"
    run_dir.mkdir()
    shutil.copy(CONFIGS / "demo.yaml", run_dir / "demo.yaml")
    fabricate_prepared_data(load_config(run_dir / "demo.yaml", overrides(run_dir)), smollm2_dir, CHATS)
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(prepared) -> Path:
    run_dir = new_run_dir(prepared, "uninterrupted")
    result = run_capture(run_dir)
    assert "shards: 4 in all" in result.stdout and "tokens/s" in result.stdout
    return run_dir


def test_states_equal_transformers_hidden_states(uninterrupted, smollm2_dir):
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    reader, layout = open_reader(uninterrupted / "02_hidden_states")
    aux_ids = layout.aux_layer_ids
    assert aux_ids == [2, 15, 27] and layout.final_layer_id == 30 and "entering decoder layer i" in layout.layer_id_convention
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    worst = {"aux": 0.0, "final": 0.0}
    for split in ("train", "eval"):
        for row in load_from_disk(str(uninterrupted / "01_data" / split)):
            with torch.no_grad():
                hf = model(torch.tensor([row["input_ids"]]), output_hidden_states=True).hidden_states
            aux, final = reader.get(row["id"])
            for column, layer_id in enumerate(aux_ids):
                worst["aux"] = max(worst["aux"], relative_error(aux[:, column], hf[layer_id][0]))
            with torch.no_grad():
                normed = model.model.norm(final.float())
            worst["final"] = max(worst["final"], relative_error(normed, hf[-1][0]))
    print(f"max relative error vs HF fp32: aux {worst['aux']:.4f}, norm(final) {worst['final']:.4f}")
    # vLLM computes in bf16 (the demo's engine dtype), HF in fp32: rounding accumulates over the 30 layers.
    assert worst["aux"] < 0.02 and worst["final"] < 0.05


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_rerun_of_a_finished_capture_is_a_no_op(uninterrupted):
    again = run_capture(uninterrupted)
    assert "already complete" in again.stdout and "capture path" not in again.stdout


def test_killed_capture_resumes_to_the_same_tensors(prepared, uninterrupted):
    run_dir = new_run_dir(prepared, "killed")
    first_shard = run_dir / "02_hidden_states" / "shard_00000.safetensors.json"
    job = subprocess.Popen(capture_command(run_dir), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)  # its own process group: the kill takes vLLM's workers too
    deadline = time.monotonic() + 600
    while not first_shard.exists() and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.poll() is None, f"the job ended (exit {job.returncode}) before its first shard was written"
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    stage_dir = run_dir / "02_hidden_states"
    assert not (stage_dir / "manifest.json").exists() and not (stage_dir / "index.json").exists()

    # resumed under other runtime knobs: batches of 1 (states within bf16 rounding of the batched ones), and
    # another shard size, which applies to a fresh run only (the partial work keeps its shards of 2)
    resumed = run_capture(run_dir, sets=("capture.batch_size=1", "capture.samples_per_shard=3"))
    assert "resuming partial work" in resumed.stdout and "4 in all" in resumed.stdout
    assert "resuming in the pieces its work began with: capture.samples_per_shard 2" in resumed.stdout
    assert "0 to capture" not in resumed.stdout and "4 to capture" not in resumed.stdout
    assert_close_states(all_states(run_dir), all_states(uninterrupted), BATCH_SIZE_BOUND)


# capture.batch_size is a runtime knob: a sample's states are its own rows whatever else is in the batch, so batch
# composition moves them by bf16 rounding at most (the engine computes in bf16; vLLM CPU gave identical states)
BATCH_SIZE_BOUND = 0.01


def assert_close_states(got: dict, want: dict, bound: float) -> None:
    assert sorted(got) == sorted(want)
    worst = max(relative_error(got[k][i], want[k][i]) for k in want for i in (0, 1))
    print(f"max relative error between the two captures: {worst:.5f}")
    assert worst <= bound


def assert_same_states(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for sample_id, (aux, final) in want.items():
        assert torch.equal(got[sample_id][0], aux) and torch.equal(got[sample_id][1], final), sample_id


def test_two_shard_jobs_give_the_unsharded_result(prepared, uninterrupted):
    run_dir = new_run_dir(prepared, "sharded")
    jobs = [subprocess.Popen(capture_command(run_dir, "--shard-index", str(i), "--num-shards", "2"), cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    outputs = [job.communicate(timeout=900) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], outputs
    assert all("2 for job" in out for out, _ in outputs)
    index = json.loads((run_dir / "02_hidden_states" / "index.json").read_text())
    reference = json.loads((uninterrupted / "02_hidden_states" / "index.json").read_text())
    assert index["samples"] == reference["samples"]
    assert_same_states(all_states(run_dir), all_states(uninterrupted))


def test_fp8_capture_halves_the_disk(prepared, uninterrupted):
    run_dir = new_run_dir(prepared, "fp8")
    run_capture(run_dir, sets=("capture.dtype=fp8",))
    size = {name: json.loads((d / "02_hidden_states" / "manifest.json").read_text())["counts"]["bytes_on_disk"]
            for name, d in (("fp8", run_dir), ("bf16", uninterrupted))}
    print(f"bytes on disk: {size}; ratio {size['fp8'] / size['bf16']:.4f}")
    assert size["fp8"] <= 0.53 * size["bf16"]
    fp8, bf16 = all_states(run_dir), all_states(uninterrupted)
    worst = max(relative_error(fp8[k][i], bf16[k][i]) for k in bf16 for i in (0, 1))
    print(f"fp8 vs bf16 max relative error {worst:.4f}")
    assert worst < 0.05


KIMI_CHATS = {
    "train": [[{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"}],
              [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "One, two, three."}]],
    "eval": [[{"role": "user", "content": "Say yes."}, {"role": "assistant", "content": "Yes."}]],
}


def test_tiny_kimi_states_equal_transformers_through_the_worker_extension(tiny_kimi_dir, tmp_path):
    """The MLA target takes the worker-extension path (vLLM's hidden-states connector refuses MLA)."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    run_dir = tmp_path / "run"
    sets = [f"run_dir={run_dir}", "target.engine.dtype=float32"]
    config = load_config(CONFIGS / "tiny_kimi.yaml", sets)
    fabricate_prepared_data(config, tiny_kimi_dir, KIMI_CHATS)
    command = [sys.executable, "02_generate_hidden_states.py", "--config", str(CONFIGS / "tiny_kimi.yaml")]
    result = subprocess.run(command + [arg for s in sets for arg in ("--set", s)], cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert "capture path: worker_extension" in result.stdout and ", text only" in result.stdout
    # vLLM's own word that the text-only data started the engine without the vision tower
    assert "running in text-only mode" in result.stdout + result.stderr

    reader, layout = open_reader(run_dir / "02_hidden_states")
    assert layout.aux_layer_ids == [2, 4, 5] and layout.final_layer_id == 8
    model = AutoModelForImageTextToText.from_pretrained(tiny_kimi_dir, dtype=torch.float32).eval()
    text_model, tokenizer = model.get_decoder(), AutoTokenizer.from_pretrained(tiny_kimi_dir)
    worst = {"aux": 0.0, "final": 0.0}
    for sample_id in reader.index:
        split, number = sample_id.split("-")
        messages = KIMI_CHATS[split][int(number)]
        ids = torch.tensor([tokenizer.apply_chat_template(messages, return_dict=False)])
        with torch.no_grad():
            hf = model(input_ids=ids, output_hidden_states=True).hidden_states
            aux, final = reader.get(sample_id)
            normed = text_model.norm(final.float())
        for column, layer_id in enumerate(layout.aux_layer_ids):
            worst["aux"] = max(worst["aux"], relative_error(aux[:, column], hf[layer_id][0]))
        worst["final"] = max(worst["final"], relative_error(normed, hf[-1][0]))
    print(f"tiny Kimi: max relative error vs HF fp32: aux {worst['aux']:.4f}, norm(final) {worst['final']:.4f}")
    # fp32 engine, but stored in bf16: the error is the storage rounding (2^-9 relative per element)
    assert worst["aux"] < 0.01 and worst["final"] < 0.01

    # target.engine.tensor_parallel_size is a runtime knob: two workers' all-reduces sum the same products in
    # another order, a float32 rounding that the bf16 storage mostly absorbs (vLLM CPU binds one core per worker)
    split_dir = tmp_path / "tensor_parallel_2"
    shutil.copytree(run_dir / "01_data", split_dir / "01_data")
    split = [*sets, f"run_dir={split_dir}", "target.engine.tensor_parallel_size=2"]
    result = subprocess.run(command + [arg for s in split for arg in ("--set", s)], cwd=ROOT, capture_output=True,
                            text=True, timeout=900, env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert_close_states(all_states(split_dir), all_states(run_dir), TENSOR_PARALLEL_BOUND)


TENSOR_PARALLEL_BOUND = 0.001  # vLLM CPU, tiny Kimi in float32 stored in bf16: 4e-5

