"""docs/config.md is the schema's own reference: equal to what `python -m eagle3_pipeline config-reference`
prints, and naming every knob of every section."""

from __future__ import annotations

import subprocess
import sys

from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.config_reference import reference, section_models, stage_table
from tests.conftest import ROOT


def test_docs_config_md_equals_the_generated_reference():
    assert (ROOT / "docs" / "config.md").read_text() == reference(), (
        "docs/config.md is stale: python -m eagle3_pipeline config-reference > docs/config.md")


def test_the_reference_names_every_knob_with_its_default():
    text = reference()
    for path, model in section_models(RunConfig):
        assert f"## {path or 'top level'}\n" in text
        for name, field in model.model_fields.items():
            assert f"| `{field.alias or name}` |" in text
    assert "| `latency_prompts` | int | `8` |" in text  # a knob, its type and its default as the schema has them


def test_the_command_prints_it():
    result = subprocess.run([sys.executable, "-m", "eagle3_pipeline", "config-reference"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == reference()


def test_the_readme_stage_table_is_stage_ios():
    assert stage_table() in (ROOT / "README.md").read_text(), (
        "README.md's stage table is stale: paste eagle3_pipeline.config_reference.stage_table()")
