"""bench/speed_model.py's reading of 06 reports and its table (the 06 runs themselves: tests/validate)."""

from __future__ import annotations

import json

import pytest

from bench.speed_model import markdown, phase_rows, reports_in


def figures(predicted: float, measured: float, requests: int) -> dict:
    return {"with_draft": {"requests": requests}, "mean_acceptance_length": 2.0, "target_step_ms": 10.0,
            "verify_forward_ms": 9.0, "draft_step_ms": 1.0, "sample_ms": 0.5, "outside_step_ms": 1.5,
            "measured_outside_step_ms": 1.7, "fixed_ms": 120.0, "plain_fixed_ms": 100.0, "model_cycle_ms": 14.0,
            "cycle_ms": 14.2, "predicted_speedup": predicted, "measured_speedup": measured}


REPORT = {"runs": [{"num_speculative_tokens": 3,
                    "speed": {"eval_batch": figures(1.10, 1.00, 48),
                              "by_concurrency": {"1": figures(1.40, 1.40, 8), "4": figures(1.19, 1.25, 8)}}}]}


def test_each_phase_is_a_row_with_the_models_miss():
    rows = phase_rows(REPORT, "run 1")
    assert [(row["phase"], row["requests"]) for row in rows] == [("eval batch", 48), ("1", 8), ("4", 8)]
    assert [row["error"] for row in rows] == pytest.approx([0.10, 0.0, 1.19 / 1.25 - 1])
    assert rows[0]["model_cycle_ms"] == 14.0 and rows[0]["report"] == "run 1" and rows[0]["k"] == 3
    table = markdown({"command": "python -m bench.speed_model ...", "machine": "a CPU", "rows": rows})
    assert "| run 1 | 3 | 4 (8) | 2.000 | 10.00 | 9.00 | 1.00 | 0.50 | 1.50 / 1.70 | 120 / 100 | 14.00 / 14.20 | " \
           "1.190 / 1.250 | -4.8% |" in table
    assert "Largest miss: 10.0% over 3 rows." in table


def test_reports_are_read_from_06s_report_or_each_job_of_a_gpu_pipeline_result(tmp_path):
    (tmp_path / "run" / "06_validate").mkdir(parents=True)
    single = tmp_path / "run" / "06_validate" / "report.json"
    single.write_text(json.dumps(REPORT))
    assert reports_in(single) == [("run", REPORT)]
    pipeline = tmp_path / "gpu_pipeline.json"
    pipeline.write_text(json.dumps({"device": "H200", "learned-kimi-v1": {"validate": REPORT},
                                    "learned-kimi-build": {"stages": []}}))
    assert reports_in(pipeline) == [("learned-kimi-v1", REPORT)]


def test_a_report_from_before_the_model_is_named():
    old = {"runs": [{"num_speculative_tokens": 3, "speed": {"eval_batch": {}, "concurrency_1": {}}}]}
    with pytest.raises(ValueError, match="v4: a 06 report from before the speed model"):
        phase_rows(old, "v4")
