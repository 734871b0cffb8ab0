"""bench/speed_model.py's reading of 06 reports and its table (the 06 runs themselves: tests/validate)."""

from __future__ import annotations

import json

import pytest

from bench.speed_model import current_model, markdown, phase_rows, reports_in


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


def test_a_gpu_report_is_predicted_again_with_the_outside_on_the_hosts_clock():
    # T 10 ms less the plain worker's step on the host's clock (7.5 ms): 2.5 ms outside, not the reported 1.5, so
    # a cycle of 15 ms; two groups of 4 (8 requests), each 120 ms fixed, then 100 decode steps in all
    gpu = figures(1.19, 1.25, 8) | {"plain_host_engine_step_ms": 7.5, "decode_steps": 100}
    model = current_model({}, "4", gpu)
    assert model["outside_step_ms"] == pytest.approx(2.5) and model["model_cycle_ms"] == pytest.approx(15.0)
    assert model["predicted_speedup"] == pytest.approx(1.19 * (240 + 14.0 * 100) / (240 + 15.0 * 100))
    # a report that took it so already (T - 8.5 = its 1.5) keeps its figures; so does one with no host clock (CPU)
    assert current_model({}, "4", gpu | {"plain_host_engine_step_ms": 8.5})["predicted_speedup"] == pytest.approx(1.19)
    assert current_model({}, "4", figures(1.19, 1.25, 8)) == {"outside_step_ms": 1.5, "model_cycle_ms": 14.0,
                                                            "predicted_speedup": 1.19}
    # the eval batch's groups are the report's eval sources
    report = {"by_source": {"mt_bench": {}, "humaneval": {}}, "runs": [
        {"num_speculative_tokens": 3, "speed": {"eval_batch": gpu, "by_concurrency": {}}}]}
    [row] = phase_rows(report, "h100")
    assert row["predicted_speedup"] == pytest.approx(model["predicted_speedup"])
    assert row["reported_speedup"] == 1.19
    assert "| 1.190 (" not in markdown({"command": "c", "machine": "m", "rows": phase_rows(REPORT, "cpu")})
    assert f"| {row['predicted_speedup']:.3f} (1.190) / 1.250 |" in markdown({"command": "c", "machine": "m",
                                                                             "rows": [row]})
