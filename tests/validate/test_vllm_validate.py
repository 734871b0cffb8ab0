"""05 + 06 end to end in vLLM CPU: the demo draft speeds SmolLM2 up; the tiny Kimi draft serves on its target.

One engine start per setting: SmolLM2 with the draft (k=3) and without; tiny Kimi with the draft only.

    python -m pytest -m vllm tests/validate/test_vllm_validate.py -s     # -s prints the acceptance figures
"""

from __future__ import annotations

import json

import pytest

from eagle3_pipeline.stage_io import read_manifest
from tests.conftest import run_python
from tests.train.fabricate import SMOLLM2_AUX_LAYER_IDS, random_samples, random_states
from tests.validate.runs import cached_run, stand_in_config, trained_stand_in_run
from tests.validate.smollm2_inputs import self_distilled_humaneval

TINY_KIMI_AUX_LAYER_IDS = [2, 4, 5]  # (2, L//2, L-3) for its 8 layers


def export_and_validate(path, run_dir) -> dict:
    for script in ("05_export.py", "06_validate.py"):
        result = run_python(script, "--config", str(path), timeout=900)
        assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((run_dir / "06_validate" / "report.json").read_text())
    run = report["runs"][0]
    print(f"\n{run_dir}: mean acceptance length {report['mean_acceptance_length']:.3f} at k=3, per position "
          f"{[round(r, 3) for r in report['acceptance_per_position']]}, drafts {run['num_drafts']}, greedy "
          f"identical {report['greedy_identical_fraction']}, eval step-0 accuracy {report['eval_step0_accuracy']}")
    assert run["skipped_parameters"] == [] and run["ignored_tensors"] == ["t2d"]
    assert run["shared_from_target"] == ["model.embed_tokens.weight"]  # the draft's own lm_head is kept
    assert read_manifest(run_dir / "06_validate") is not None
    return report


# The demo's draft shape, trained on SmolLM2's own answers to 152 HumanEval prompts (3 epochs; about 5 minutes
# on 2 idle cores, once: the finished run is cached), served on the 12 held-out ones.
DEMO_TRAIN = {"max_steps": 256, "warmup_steps": 4, "eval_every": 128, "checkpoint_every": 256, "log_every": 8}
DEMO_VALIDATE = {"max_prompts": 12, "max_tokens": 48}


def build_demo_run(config) -> None:
    from eagle3_pipeline.stand_ins import ensure_stand_in

    samples, states = self_distilled_humaneval(ensure_stand_in("smollm2-135m-instruct"), 164, 96)
    trained_stand_in_run(config, samples, states, eval_count=12, vocab=49152, aux_layer_ids=SMOLLM2_AUX_LAYER_IDS)


@pytest.mark.vllm
def test_demo_draft_speeds_up_smollm2(tmp_path):
    config, path = cached_run(tmp_path, "smollm2-demo-draft-v1", "demo", DEMO_TRAIN, DEMO_VALIDATE, build_demo_run)
    report = export_and_validate(path, config.run_dir)
    assert report["num_speculative_tokens"] == 3 and len(report["acceptance_per_position"]) == 3
    assert report["mean_acceptance_length"] > 1.5
    assert report["greedy_identical_fraction"] is not None
    assert (config.run_dir / "06_validate" / "acceptance.png").stat().st_size > 10_000
    assert "vllm serve" in (config.run_dir / "06_validate" / "report.md").read_text()


@pytest.mark.vllm
def test_tiny_kimi_draft_serves_on_the_tiny_kimi_target(tmp_path, tiny_kimi_dir):
    """Random target, random states: the figures mean nothing; loading and speculation on an MLA target do."""
    config, path = stand_in_config(
        tmp_path, "tiny_kimi",
        train={"max_steps": 2, "warmup_steps": 1, "eval_every": 2, "checkpoint_every": 2, "log_every": 1},
        validate={"max_prompts": 2, "max_tokens": 12, "compare_without_speculation": False},
    )
    samples = random_samples(20, 163584, seed=1, prefix="k")  # ordinary token ids, below Kimi's special ones
    states = random_states(samples, len(TINY_KIMI_AUX_LAYER_IDS), 256, seed=2)
    trained_stand_in_run(config, samples, states, eval_count=2, vocab=163840, aux_layer_ids=TINY_KIMI_AUX_LAYER_IDS)
    report = export_and_validate(path, config.run_dir)
    assert report["runs"][0]["num_drafts"] > 0 and report["greedy_identical_fraction"] is None
