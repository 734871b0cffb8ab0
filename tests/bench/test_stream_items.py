"""bench/stream_items.py: each step of one stream item timed on a pack that round-trips."""

from __future__ import annotations

from bench import stream_items


def test_each_step_is_timed_on_a_pack_of_the_shape(monkeypatch, tmp_path):
    monkeypatch.setitem(stream_items.SHAPES, "tiny", (10, 3, 8, 4))
    result = stream_items.time_steps("tiny", 2, tmp_path)
    assert (result["rows"], result["samples"]) == (10, 3)  # samples of 4, 4 and 2 tokens
    assert result["bytes"] > 10 * 4 * 8 * 2  # every row's four bf16 states, plus the header
    assert set(result["ms"]) == set(stream_items.STEPS)
    assert all(len(times) == 2 and min(times) >= 0 for times in result["ms_each"].values())
    assert not list(tmp_path.iterdir())  # the item deleted after each repeat
