"""04's inputs in stream mode: a stream planned under another pack plan is refused before any pack is read (which
is why 02's fingerprint need not hold the plan's knobs it reads: tests/stage_reads.py, STREAM_ORDER)."""

from __future__ import annotations

import json

import pytest

from eagle3_pipeline.pack_plan import plan_settings
from eagle3_pipeline.stage_io import STREAM, StageError
from eagle3_pipeline.train.inputs import stream_consumer
from tests.stage_reads import STREAM_ORDER
from tests.train.fabricate import tiny_run_config


@pytest.mark.parametrize("knob", sorted(STREAM_ORDER))
def test_a_stream_planned_under_other_pack_settings_is_refused(tmp_path, knob):
    streamed, _ = tiny_run_config(tmp_path / "run", tmp_path / "target", capture={"mode": "stream"})
    states = tmp_path / "run" / "02_hidden_states"
    states.mkdir(parents=True)
    (states / STREAM).write_text(json.dumps({"pack_plan": plan_settings(streamed)}))
    section, name = knob.split(".")
    changed, _ = tiny_run_config(tmp_path / "run", tmp_path / "target", capture={"mode": "stream"},
                                 **{name: getattr(streamed.train, name) + 1})
    with pytest.raises(StageError, match="rerun 02_generate_hidden_states.py --force"):
        stream_consumer(changed, states, layout=None)
    assert {f"train.{key}" for key in plan_settings(streamed)} == STREAM_ORDER
