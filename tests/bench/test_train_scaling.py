"""bench/train_scaling.py: its plan of runs, its analysis of a saved result (recomputed from the runs it holds),
and the tiny CPU run (gloo): 2 processes and a 2 -> 1 -> 2 process chain follow the 1-process curve."""

from __future__ import annotations

import json

import pytest

from bench.train_scaling import SHAPES, schedule, summarize
from tests.conftest import ROOT, run_python


def test_runs_go_in_priority_order_with_their_legs():
    plans = {name: {"shape": SHAPES[name]} for name in ("kimi", "demo")}
    queue = [(name, run) for name, run, _ in schedule(plans, [2, 4])]
    assert queue == [("kimi", "one"), ("kimi", "multi_2"), ("kimi", "multi_4"), ("demo", "one"), ("demo", "multi_2"),
                     ("demo", "multi_4"), ("kimi", "chain_4_1_4"), ("demo", "chain_4_1_4"), ("demo", "one_again"),
                     ("demo", "one_half")]
    legs = {(name, run): legs for name, run, legs in schedule(plans, [2, 4])}
    assert legs["kimi", "chain_4_1_4"] == [(4, 1, 10), (1, 4, 15), (4, 1, None)]  # the global batch of 4 packs
    assert legs["demo", "one_half"] == [(1, 2, None)]


def test_a_saved_result_is_what_its_runs_give():
    result = json.loads((ROOT / "bench" / "results" / "train_scaling_h200x2.json").read_text())
    for name, entry in result["shapes"].items():
        summary = summarize(entry["runs"], SHAPES[name], entry["config"]["mixed_precision"], result["processes"])
        assert summary == {key: entry[key] for key in summary}, name
    kimi = result["shapes"]["kimi"]
    assert kimi["scaling"]["2"]["efficiency"] == pytest.approx(0.863, abs=1e-3)  # docs/cost.md's figure
    assert kimi["comparisons"]["chain_2_1_2_vs_one"]["within_tolerance"]


@pytest.mark.slow
def test_tiny_scaling_run_follows_the_one_process_curve(tmp_path):
    out = tmp_path / "scaling.json"
    result = run_python("-m", "bench.train_scaling", "--shapes", "tiny", "--runs", "one", "multi_2", "chain_2_1_2",
                        "--work", str(tmp_path / "work"), "--out", str(out))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tiny = json.loads(out.read_text())["shapes"]["tiny"]
    chain = tiny["runs"]["chain_2_1_2"]
    assert [(leg["processes"], leg["stop_at_step"]) for leg in chain["legs"]] == [(2, 3), (1, 4), (2, None)]
    assert "--resume" in chain["legs"][1]["command"] and not chain.get("unfinished")
    for name in ("multi_2_vs_one", "chain_2_1_2_vs_one"):
        comparison = tiny["comparisons"][name]
        assert comparison["within_tolerance"] and comparison["all_steps_compared"], name
        assert comparison["eval"]["max_rel_loss"] <= tiny["tolerance_rel_loss"], name
    assert tiny["scaling"]["2"]["tokens_per_s"] > 0
    assert "written by 2 process(es)" in (tmp_path / "scaling.log").read_text()
