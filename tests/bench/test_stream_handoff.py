"""bench/stream_handoff.py: the pipeline's own producer and consumer hand every position over, once each."""

from __future__ import annotations

from bench.stream_handoff import GpuWork, run


def test_every_position_is_captured_once_and_trained_on(tmp_path):
    steps = 6
    result = run(tmp_path, steps, capture_s=0.001, train_s=0.001, first_poll_s=0.001, window_gb=0.001, poll_s=0.01,
                 loader_workers=2, rows=64)
    assert result["packs"] == steps and result["bytes"] == steps * result["pack_mb"] * 1e6
    assert 1 <= result["engine_calls"] <= steps and 0 <= result["data_wait_share"] <= 1
    assert not list(tmp_path.glob("pack_*"))  # 04 consumed (deleted) every item it trained on


def test_the_gpus_work_runs_as_many_products_as_the_asked_seconds_hold(monkeypatch):
    work = GpuWork("cpu", 8)
    assert work.product_s > 0
    counts = []
    monkeypatch.setattr(work, "products", counts.append)
    work.product_s = 0.002
    work(0.05)
    work(0.0001)  # shorter than one product: one all the same
    assert counts == [25, 1]


def test_with_a_device_both_sides_do_matrix_products_there_and_report_what_they_took(tmp_path):
    steps = 4
    result = run(tmp_path, steps, capture_s=0.002, train_s=0.002, first_poll_s=0.001, window_gb=0.001, poll_s=0.01,
                 loader_workers=1, rows=64, device="cpu")
    assert result["packs"] == steps and result["device"] == "cpu"
    assert result["capture_ms_taken"] > 0 and result["train_ms_taken"] > 0


def test_each_engine_call_costs_its_fixed_time_and_capture_ahead_still_hands_every_position_over_once(tmp_path):
    steps, call_s = 6, 0.05
    result = run(tmp_path, steps, capture_s=0.001, train_s=0.001, first_poll_s=0.001, window_gb=0.001, poll_s=0.01,
                 loader_workers=2, rows=64, call_s=call_s, ahead_gb=0.001)
    assert result["packs"] == steps and result["ahead_gb"] == 0.001 and result["call_ms"] == call_s * 1e3
    engine_ms = result["capture_ms_taken"] * result["packs"]
    assert engine_ms >= result["engine_calls"] * (call_s + 0.001) * 1e3
    assert not list(tmp_path.glob("pack_*"))
