"""bench/draft_eval.py scores an exported draft as 04 scored it before export, in either format and attention."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.draft_eval import EvalRows, evaluate
from eagle3_pipeline.export import stage as export_stage
from eagle3_pipeline.stage_io import MANIFEST
from eagle3_pipeline.train import loop
from tests.train.fabricate import tiny_run
from tests.train.test_draft_model import MLA  # draft.attention mla at the tiny size

# (draft section, exported format): an MLA draft exports the reference layout only
LAYOUTS = {"reference": ({}, "speculators"), "eagle31": ({"fc_norm": True, "norm_output": True}, "speculators"),
           "reference-layout-folder": ({}, "reference"), "mla": (MLA, "reference")}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_exported_draft_scores_what_04s_last_eval_measured(tmp_path, layout):
    draft, folder = LAYOUTS[layout]
    # a prefixed target (Kimi's `language_model.`): the evaluator must read the frozen tensors under it
    config, _ = tiny_run(tmp_path, draft=draft, export={"formats": [folder]}, weight_prefix="language_model.")
    loop.run(config)
    export_stage.run(config)
    recorded = json.loads((config.run_dir / "04_train" / MANIFEST).read_text())["counts"]
    steps = config.train.ttt_steps
    rows = EvalRows(config.run_dir, config.train.packed_length)
    figures = evaluate(config.run_dir / "05_export" / folder, rows, steps, verifier_dir=Path(config.target.path),
                       weight_prefix="language_model.")
    assert [figures[f"acc_{k}"] for k in range(steps)] == pytest.approx(recorded["eval_accuracy"], abs=1e-6)
    # the export stores bf16 weights: the loss moves by their rounding
    assert [figures[f"loss_{k}"] for k in range(steps)] == pytest.approx(recorded["eval_loss"], rel=2e-3)
    assert all(figures[f"chain_acc_{k}"] <= figures[f"acc_{k}"] for k in range(steps))


def test_a_reference_folder_needs_its_verifier(tmp_path):
    config, _ = tiny_run(tmp_path, export={"formats": ["reference"]})
    loop.run(config)
    export_stage.run(config)
    with pytest.raises(ValueError, match="does not name its verifier"):
        evaluate(config.run_dir / "05_export" / "reference", EvalRows(config.run_dir, config.train.packed_length), 1)
