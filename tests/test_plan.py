"""`python -m eagle3_pipeline plan`: docs/cost.md's table is what the command prints, the arithmetic matches a
hand computation from the published and measured figures, and a config that does not say its size is refused."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from eagle3_pipeline import plan
from eagle3_pipeline.__main__ import parser, plan_text
from eagle3_pipeline.config import load_config
from tests.conftest import ROOT

KIMI = ROOT / "configs" / "kimi_k25.yaml"


def test_the_cost_page_is_what_plan_prints():
    section = (ROOT / "docs" / "cost.md").read_text()
    command = re.search(r"```bash\n(python -m eagle3_pipeline plan [^\n]+)\n```", section).group(1)
    args = parser().parse_args(shlex.split(command)[3:])
    printed = plan_text(args)
    assert printed in section, "docs/cost.md is stale: rerun the command there and paste its output"
    result = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout == printed


def test_one_row_against_a_hand_computation():
    """600k conversations, 1k-token prompts, 3k-token answers on configs/kimi_k25.yaml, from the rates' own figures."""
    config = load_config(KIMI)
    data = plan.plan_data(config, str(KIMI), 600_000, 3000, 1000)
    stages = plan.stage_gpu_hours(config, data)
    node = 8 / 3600  # GPU-hours per node-second
    regeneration = 600_000 * 3000 / (16.7 * 64) * node
    prefill = 73_700 * (1 - 0.563) * 37 / 32 * 989 / 1979
    capture = 600_000 * 4000 * (1 / prefill + 5.216e-6) * node
    training = 600_000 * 4000 / (34_586 / (760.2 / 476.8) * 8 * 0.863) * node  # train.optimizer muon
    # 06: an engine with the draft at k=3 and one without, each: start, 256 prompts x 512 tokens batched, 8 alone
    # latency groups: 8 prompts one at a time, 2 groups of 4, one of 16 (validate.latency_concurrency [1, 4, 16])
    validation = 2 * (600 + 256 * 512 / (16.7 * 64) + (8 + 2 + 1) * 512 / 91.2) * node
    assert stages == pytest.approx({
        "01 regeneration, target alone": regeneration, "01 regeneration, with a draft": regeneration / 1.20,
        "02 capture, offline (once)": capture, "02 capture, stream (per epoch)": capture,
        "04 training (per epoch)": training, "06 validation": validation}, rel=1e-3)
    assert regeneration == pytest.approx(3742.5, abs=0.1)  # docs/cost.md's 3,743

    one_node = plan.layout_totals(stages, "01 regeneration, target alone", None)
    assert one_node == pytest.approx((regeneration + capture + training + validation,
                                      (regeneration + capture + training + validation) / 8), rel=1e-3)
    split = plan.split_layout(None, 1, "muon")
    assert split == (9, 1)  # 149,765 Muon training tokens/s of one node over 16,964 captured per node
    assert plan.split_layout(None, 1, "adamw") == (14, 1)  # 238,782 with AdamW
    stream_hours = max(capture / (9 * 8), training / 8)
    assert plan.layout_totals(stages, None, split) == pytest.approx(
        (validation + stream_hours * 10 * 8, validation / 8 + stream_hours), rel=1e-3)


def test_answers_are_capped_by_max_tokens_and_samples_by_max_seq_len():
    config = load_config(KIMI)
    data = plan.plan_data(config, str(KIMI), 10, 20_000, 1000)
    assert (data.answer_tokens, data.sample_tokens) == (16_384, 16_384)
    assert plan.plan_data(config, str(KIMI), None, None, 1000).conversations == 400_000  # two sources of 200k


def test_public_data_skips_regeneration():
    config = load_config(KIMI, ["data.regenerate.enabled=false"])
    stages = plan.stage_gpu_hours(config, plan.plan_data(config, str(KIMI), 1000, 3000, 1000))
    assert stages["01 regeneration, target alone"] is None and stages["01 regeneration, with a draft"] is None
    assert "skipped (data.regenerate.enabled: false)" in plan.render(config, str(KIMI), 1000, [3000])


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eagle3_pipeline", "plan", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_a_source_without_a_limit_needs_conversations():
    unsized = "data.sources=[{kind: file, name: /data/kimi-mtp.jsonl, schema: kimi_mtp}]"
    result = run_plan(str(KIMI), "--set", unsized)
    assert result.returncode == 2
    assert result.stderr == (f"config error: {KIMI}: data.sources[0] (file /data/kimi-mtp.jsonl) has no limit, so "
                             "its size is unknown: pass --conversations N\n")
    assert run_plan(str(KIMI), "--set", unsized, "--conversations", "477000").returncode == 0


def test_bad_numbers_and_configs_exit_2_in_one_line():
    for args in (["--conversations", "0"], ["--answer-tokens", "3k"]):
        result = run_plan(str(KIMI), *args)
        assert result.returncode == 2 and "expected a whole number >= 1" in result.stderr
    result = run_plan(str(KIMI), "--set", "data.regenerate.max_tokens=0")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "data.regenerate.max_tokens" in result.stderr
