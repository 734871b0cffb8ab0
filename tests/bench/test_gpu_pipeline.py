"""bench.gpu_pipeline refuses to start where the project's vLLM plugin is not installed."""

import importlib.metadata
import sys

import pytest

from bench import gpu_pipeline


def test_the_plugin_is_found_where_the_project_is_installed():
    assert gpu_pipeline.plugin_installed()


def test_a_node_without_the_plugin_is_refused_before_any_job(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(sys, "argv", ["gpu_pipeline", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    with pytest.raises(SystemExit, match="eagle3_pipeline_patches.*is not installed"):
        gpu_pipeline.main()
    assert not (tmp_path / "out").exists()
