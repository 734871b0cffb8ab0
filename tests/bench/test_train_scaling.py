"""The multi-process scaling benchmark runs tiny on CPU (gloo): 2 processes and a 2 -> 1 -> 2 process chain
follow the 1-process curve, and the JSON holds the comparisons and throughput."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_python


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
