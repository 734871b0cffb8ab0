"""bench/stream.py's report: the table of offline against stream mode from the runs' figures."""

from __future__ import annotations

import argparse
import json

from bench.stream import report, training_figures

OFFLINE = {"tokens_per_s_median": 583.4, "data_wait_share": 0.002, "steps_s": 2.6, "capture_stage_s": 196.5,
           "train_stage_s": 54.7, "wall_s": 251.3, "bytes_on_disk": 44_000_000, "losses": [2.5, 2.25]}
STREAM = {"tokens_per_s_median": 84.2, "data_wait_share": 0.343, "steps_s": 17.0, "capture_wait_frac": 0.0341,
          "capture_batches": 31, "capture_stage_s": 598.7, "train_stage_s": 596.1, "wall_s": 598.7,
          "most_held_bytes": 14_500_000, "window_bytes": 20_000_000, "losses": [2.5, 2.25]}


def test_report_table():
    args = argparse.Namespace(prepared=None, samples=48, max_tokens=320, config="configs/demo.yaml",
                              packed_length=1024, steps=24)
    assert report([OFFLINE, STREAM], args) == """\
48 HumanEval chats (<= 320 tokens), configs/demo.yaml, packed 1024, 24 steps; per-step losses equal: True (largest \
difference 0.0)

| | offline | stream |
|---|---|---|
| 04 training tokens/s (median) | 583 | 84 |
| 04 steps 2-N wall s | 2.6 | 17.0 |
| 04 time waiting for data | 0.2% | 34.3% |
| 02 time waiting for room | - | 3.4% |
| 02 engine calls for the packs | - | 31 |
| 02 stage wall s | 196.5 | 598.7 |
| 04 stage wall s | 54.7 | 596.1 |
| 02 + 04 wall s | 251.3 | 598.7 |
| states on disk, most | 44.0 MB | 14.5 MB (window 20 MB) |
"""


def test_report_names_the_prepared_run_and_the_largest_loss_difference():
    args = argparse.Namespace(prepared="RUN", samples=0, max_tokens=0, config="c.yaml", packed_length=8192, steps=60)
    text = report([OFFLINE, STREAM | {"losses": [2.5, 2.0]}], args)
    assert text.startswith("01 and 03 of RUN, c.yaml, packed 8192, 60 steps; per-step losses equal: False (largest "
                           "difference 0.25)")


def test_report_has_a_column_per_stream_window():
    args = argparse.Namespace(prepared="RUN", samples=0, max_tokens=0, config="c.yaml", packed_length=8192, steps=60)
    wide = STREAM | {"window_bytes": 2_000_000_000, "data_wait_share": 0.1, "losses": [2.5, 2.125]}
    lines = report([OFFLINE, STREAM, wide], args).splitlines()
    assert "(largest difference 0.125)" in lines[0]
    assert lines[2] == "| | offline | stream | stream |"
    assert "| 04 time waiting for data | 0.2% | 34.3% | 10.0% |" in lines
    assert "| states on disk, most | 44.0 MB | 14.5 MB (window 20 MB) | 14.5 MB (window 2000 MB) |" in lines


def test_report_says_how_much_each_stream_run_may_capture_ahead():
    args = argparse.Namespace(prepared="RUN", samples=0, max_tokens=0, config="c.yaml", packed_length=8192, steps=60)
    lines = report([OFFLINE, STREAM | {"ahead_bytes": 0}, STREAM | {"ahead_bytes": 400_000_000}], args).splitlines()
    assert lines[-1] == "| 02 may capture ahead, in host memory | - | 0 MB | 400 MB |"
    assert "ahead" not in report([OFFLINE, STREAM], args)


def test_the_wait_share_weighs_each_step_by_its_time(tmp_path):
    """One step of 1 s waiting 90% and three of 0.1 s waiting 0%: 0.9 s of 1.3 s, not the mean fraction 22.5%."""
    steps = [(5.0, 0.5), (1.0, 0.9), (0.1, 0.0), (0.1, 0.0), (0.1, 0.0)]  # the first (start-up) is left out
    rows = [{"split": "train", "step": i, "loss_0": 2.0, "tokens_per_s": 8192 / s, "data_wait_frac": w, "interval_s": s}
            for i, (s, w) in enumerate(steps, 1)]
    (tmp_path / "04_train").mkdir()
    (tmp_path / "04_train" / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    (tmp_path / "04_train" / "manifest.json").write_text(json.dumps({"counts": {"train_tokens_this_launch": 40960}}))
    figures = training_figures(tmp_path)
    assert abs(figures["data_wait_share"] - 0.9 / 1.3) < 1e-9 and figures["steps_s"] == 1.3
