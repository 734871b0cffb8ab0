"""bench/report.py renders each saved result to the report committed beside it, byte for byte."""

from __future__ import annotations

import json

import pytest

from bench.report import RENDERERS
from tests.conftest import ROOT

RESULTS = {"quality": "quality", "quality_gpu": "quality_gpu", "quality_gpu_muon": "quality_gpu",
           "quality_gpu_levers": "quality_gpu", "quality_gpu_kimi": "quality_gpu"}


@pytest.mark.parametrize("result", sorted(RESULTS))
def test_a_saved_result_renders_to_its_committed_report(result, tmp_path):
    markdown, plot = RENDERERS[RESULTS[result]]
    report = json.loads((ROOT / "bench" / "results" / f"{result}.json").read_text())
    assert markdown(report) == (ROOT / "bench" / "results" / f"{result}.md").read_text()
    plot(report, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
