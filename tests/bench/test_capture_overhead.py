"""bench/capture_overhead.py's plan and report (no engine): which plain engines capture is timed against, and
capture's time over each."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from bench.capture_overhead import plain_engines, summary, timed_batches


def config(eager: bool):
    return SimpleNamespace(target=SimpleNamespace(engine=SimpleNamespace(enforce_eager=eager)))


def test_the_configs_engine_is_timed_too_where_the_capturer_changes_its_settings():
    worker_extension = {"enable_prefix_caching": False, "enforce_eager": True}
    assert list(plain_engines(config(False), worker_extension)) == ["plain, capturer's settings",
                                                                     "plain, config's settings"]
    assert list(plain_engines(config(True), worker_extension)) == ["plain, capturer's settings"]
    assert list(plain_engines(config(False), {"enable_prefix_caching": False})) == ["plain, capturer's settings"]


def test_every_batch_is_timed_after_one_warm_up():
    samples = [SimpleNamespace(input_ids=[i], images=()) for i in range(5)]
    seen = []
    assert timed_batches(samples, 2, seen.append) >= 0
    assert seen == [[([0], []), ([1], [])], [([0], []), ([1], [])], [([2], []), ([3], [])], [([4], [])]]
    # the capture's batches go to capture_batches at once (each read while the next is prefilled)
    warm, at_once = [], []
    timed_batches(samples, 2, warm.append, at_once.append)
    assert warm == [[([0], []), ([1], [])]] and at_once == [seen[1:]]


def test_capture_over_each_plain_engine():
    rows = {"plain, capturer's settings": {"seconds": 1.15}, "plain, config's settings": {"seconds": 1.0},
            "capture": {"seconds": 2.3}}
    result = summary(argparse.Namespace(config="c.yaml"), [], [1, 2], 10, 256, rows)
    assert result["capture_over_plain"] == {"plain, capturer's settings": 2.0, "plain, config's settings": 2.3}
