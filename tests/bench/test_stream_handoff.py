"""bench/stream_handoff.py: the pipeline's own producer and consumer hand every position over, once each."""

from __future__ import annotations

from bench.stream_handoff import run


def test_every_position_is_captured_once_and_trained_on(tmp_path):
    steps = 6
    result = run(tmp_path, steps, capture_s=0.001, train_s=0.001, first_poll_s=0.001, window_gb=0.001, poll_s=0.01,
                 loader_workers=2, rows=64)
    assert result["packs"] == steps and result["bytes"] == steps * result["pack_mb"] * 1e6
    assert 1 <= result["engine_calls"] <= steps and 0 <= result["data_wait_share"] <= 1
    assert not list(tmp_path.glob("pack_*"))  # 04 consumed (deleted) every item it trained on
