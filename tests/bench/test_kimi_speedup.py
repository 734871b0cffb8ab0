"""bench/kimi_speedup.py: the bytes it counts, 06's model at one request, the host parts it reads from 06 reports."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.harness import ROOT
from bench.kimi_speedup import K, draft_step_bytes, host_parts, kimi_step_bytes, speedup, table

NO_HOST = {"sample_ms": 0.0, "plain_sample_ms": 0.0, "outside_ms": 0.0, "draft_step_floor_ms": 0.0}


def test_the_draft_step_reads_the_reference_drafts_layer_norm_and_head_in_bf16():
    hidden, heads, ffn = 7168, 64 * 128, 18432
    by_hand = 3 * heads * 2 * hidden + hidden * heads + 3 * ffn * hidden + 32000 * hidden + 4 * hidden
    assert draft_step_bytes() == by_hand * 2
    dense, routed = kimi_step_bytes(1)
    assert dense + routed == pytest.approx(33.0e9, rel=2e-3)  # the figure docs/cost.md quotes
    # 4 tokens read 4 x 8 of the 384 experts; 64 tokens could read no more than all of them
    assert kimi_step_bytes(4)[1] == pytest.approx(4 * routed) and kimi_step_bytes(64)[1] == kimi_step_bytes(48)[1]


def test_without_host_parts_the_model_is_al_t_over_verify_and_k_draft_steps():
    forward, draft_ratio = 10.0, 0.06
    assert speedup(forward, 2.0, draft_ratio, NO_HOST, 3.0) == pytest.approx(3.0 * forward / (2 * forward + K * 0.6))
    # the host's parts: the cycle pays sampling with rejection and the outside, the decode step its own sampling
    host = {"sample_ms": 0.5, "plain_sample_ms": 0.1, "outside_ms": 0.3, "draft_step_floor_ms": 1.0}
    assert speedup(forward, 1.0, draft_ratio, host, 3.0) == pytest.approx(3.0 * 10.4 / (10 + K * 1.0 + 0.8))


def figures(sample_ms: float, plain_sample_ms: float, outside_ms: float) -> dict:
    return {"sample_ms": sample_ms, "plain_worker_mean_ms": {"sample_tokens": plain_sample_ms},
            "outside_step_ms": outside_ms, "draft_step_ms": 0.4, "predicted_speedup": 0.6, "target_step_ms": 2.5,
            "model_cycle_ms": 4.5, "fixed_ms": 20.0, "decode_steps": 500, "with_draft": {"requests": 16}}


def test_host_parts_are_the_reports_means_at_one_request_with_the_outside_as_06_takes_it_now(tmp_path):
    paths = []
    for i, (sample, plain, outside) in enumerate([(0.5, 0.1, 0.2), (0.7, 0.3, 0.4)]):
        report = {"runs": [{"num_speculative_tokens": 3, "speed": {"eval_batch": {}, "by_concurrency": {
            "1": figures(sample, plain, outside), "4": figures(9.0, 9.0, 9.0)}}}]}
        paths.append(tmp_path / f"report_{i}.json")
        paths[-1].write_text(json.dumps(report))
    assert host_parts(paths) == pytest.approx({"sample_ms": 0.6, "plain_sample_ms": 0.2, "outside_ms": 0.3,
                                               "draft_step_floor_ms": 0.4})
    # a report that has the plain worker's step on the host's clock: T 2.5 less 2.0 ms outside
    report = json.loads(paths[0].read_text())
    report["runs"][0]["speed"]["by_concurrency"]["1"]["plain_host_engine_step_ms"] = 2.0
    paths[0].write_text(json.dumps(report))
    assert host_parts(paths[:1])["outside_ms"] == pytest.approx(0.5)
    rows = table(host_parts(paths))["rows"]
    assert len(rows) == 4 and all(set(row["speedup"]) == {"MT-Bench", "HumanEval", "GSM8K", "MATH500"}
                                  for row in rows)


def test_a_missing_report_is_a_usage_error_in_one_line(tmp_path):
    run = subprocess.run([sys.executable, "-m", "bench.kimi_speedup", "--reports", str(tmp_path / "none.json"),
                          "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 2 and "none.json" in run.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out.json").exists()
