"""bench/draft_eval.py scores an exported draft as 04 scored it before export."""

from __future__ import annotations

import json

import pytest

from bench.draft_eval import EvalRows, evaluate
from eagle3_pipeline.export import stage as export_stage
from eagle3_pipeline.stage_io import MANIFEST
from eagle3_pipeline.train import loop
from tests.train.fabricate import tiny_run


@pytest.mark.parametrize("draft", [{}, {"fc_norm": True, "norm_output": True}], ids=["reference", "eagle31"])
def test_exported_draft_scores_what_04s_last_eval_measured(tmp_path, draft):
    config, _ = tiny_run(tmp_path, draft=draft)
    loop.run(config)
    export_stage.run(config)
    recorded = json.loads((config.run_dir / "04_train" / MANIFEST).read_text())["counts"]
    steps = config.train.ttt_steps
    rows = EvalRows(config.run_dir, config.train.packed_length)
    figures = evaluate(config.run_dir / "05_export" / "speculators", rows, steps)
    assert [figures[f"acc_{k}"] for k in range(steps)] == pytest.approx(recorded["eval_accuracy"], abs=1e-6)
    # the export stores bf16 weights: the loss moves by their rounding
    assert [figures[f"loss_{k}"] for k in range(steps)] == pytest.approx(recorded["eval_loss"], rel=2e-3)
    assert all(figures[f"chain_acc_{k}"] <= figures[f"acc_{k}"] for k in range(steps))
