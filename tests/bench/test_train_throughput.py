"""The throughput benchmark runs tiny on CPU, both models, and writes its JSON; a saved result renders to the
report committed beside it."""

from __future__ import annotations

import json
import sys

import pytest

from bench.train_throughput import write_markdown
from tests.conftest import ROOT


@pytest.mark.parametrize("name", ["train_throughput_h200", "train_throughput_h200_before", "train_throughput_h200_muon"])
def test_a_saved_result_renders_to_its_committed_report(name, tmp_path):
    result = ROOT / "bench" / "results" / f"{name}.json"
    write_markdown(json.loads(result.read_text()), tmp_path / "report.md")
    assert (tmp_path / "report.md").read_text() == result.with_suffix(".md").read_text()


@pytest.mark.slow
def test_tiny_benchmark_measures_both_models(tmp_path, monkeypatch, capsys):
    from bench import train_throughput as bench

    out = tmp_path / "result.json"
    monkeypatch.setattr(sys, "argv", ["train_throughput.py", "--tiny", "--packed-length", "128", "--warmup", "1",
                                      "--steps", "1", "--profile", "--out", str(out)])
    bench.main()
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"ours", "ours loss_chunk_rows=1024", 'ours optimizer="muon"', "speculators"}
    assert result["runs"]['ours optimizer="muon"']["options"]["optimizer"] == "muon"
    for run in result["runs"].values():
        assert run["tokens_per_s"] > 0 and run["gflop_per_token"] > 0 and run["profile"]["kinds"]
    # ours trains lm_head (2048 x 256), speculators' trainer leaves it frozen
    assert result["runs"]["ours"]["trainable_parameters"] - result["runs"]["speculators"]["trainable_parameters"] \
        == 2048 * 256
    assert "tokens/s" in capsys.readouterr().out
    assert "| ours loss_chunk_rows=1024 |" in out.with_suffix(".md").read_text()

    # --set reaches the draft: a draft vocabulary of 4096 instead of 2048 trains 2048 more rows of lm_head
    wider = tmp_path / "wider.json"
    monkeypatch.setattr(sys, "argv", ["train_throughput.py", "--tiny", "--packed-length", "128", "--warmup", "1",
                                      "--steps", "1", "--only", "ours", "--set", "draft.draft_vocab_size=4096",
                                      "--out", str(wider)])
    bench.main()
    assert json.loads(wider.read_text())["runs"]["ours"]["trainable_parameters"] \
        - result["runs"]["ours"]["trainable_parameters"] == 2048 * 256
    assert "draft.draft_vocab_size=4096" in wider.with_suffix(".md").read_text()
