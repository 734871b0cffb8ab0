"""bench/capture_overhead.py's plan and report (no engine): which plain engines capture is timed against, and
capture's time over each."""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from types import SimpleNamespace

from bench.capture_overhead import (
    chosen_samples,
    plain_engines,
    profiler_settings,
    summary,
    timed_batches,
    trace_summary,
)


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
    # a capture's parts are counted from the end of the warm-up
    order = []
    timed_batches(samples, 2, lambda batch: order.append("batch"), warmed_up=lambda: order.append("counted"))
    assert order == ["batch", "counted", "batch", "batch", "batch"]


def test_repeat_takes_the_samples_again_up_to_the_most():
    assert chosen_samples([1, 2, 3], 2000, 1) == [1, 2, 3]
    assert chosen_samples([1, 2, 3], 2000, 3) == [1, 2, 3] * 3
    assert chosen_samples([1, 2, 3], 7, 3) == [1, 2, 3, 1, 2, 3, 1]


def test_capture_over_each_plain_engine():
    rows = {"plain, capturer's settings": {"seconds": 1.15}, "plain, config's settings": {"seconds": 1.0},
            "capture": {"seconds": 2.3}, "capture, serial": {"seconds": 2.0}}
    result = summary(argparse.Namespace(config="c.yaml", repeat=1), [], [1, 2], 10, 256, rows)
    assert result["capture_over_plain"] == {
        "capture": {"plain, capturer's settings": 2.0, "plain, config's settings": 2.3},
        "capture, serial": {"plain, capturer's settings": 2.0 / 1.15, "plain, config's settings": 2.0}}


def test_each_engine_profiles_into_a_folder_of_its_own():
    assert profiler_settings(None, "capture") == {}
    settings = profiler_settings(Path("/p"), "plain, capturer's settings")["profiler_config"]
    assert settings["profiler"] == "torch" and settings["torch_profiler_dir"] == "/p/plain_capturer_s_settings"


def test_a_trace_sums_host_runtime_and_device_time_by_name(tmp_path):
    def event(category, name, start, duration):
        return {"ph": "X", "cat": category, "name": name, "ts": start, "dur": duration}

    events = [event("cpu_op", "aten::copy_", 0, 300), event("cpu_op", "aten::copy_", 1000, 100),
              event("cuda_runtime", "cudaHostAlloc", 50, 2000), event("kernel", "gemm", 400, 500),
              event("gpu_memcpy", "Memcpy DtoH", 2500, 1500), {"ph": "i", "cat": "cpu_op", "name": "mark", "ts": 9},
              # vLLM's step marks: a batch of 8 prefilled as 1 request, then 7; an empty step between batches
              event("user_annotation", "execute_context_7(1365)_generation_0(0)", 600, 900),
              event("user_annotation", "execute_context_1(219)_generation_0(0)", 100, 200),
              event("user_annotation", "execute_context_0(0)_generation_0(0)", 1600, 10)]
    trace = tmp_path / "worker.pt.trace.json.gz"
    with gzip.open(trace, "wt") as file:
        json.dump({"traceEvents": events}, file)
    summary = trace_summary(trace)
    assert summary["span_ms"] == 4.0  # 0 us to 4,000 us
    assert summary["steps"] == [{"prefill_requests": 1, "prefill_tokens": 219, "ms": 0.2},
                                {"prefill_requests": 7, "prefill_tokens": 1365, "ms": 0.9}]
    host = summary["host operators"]  # operators and step marks, inclusive
    assert host["total_ms"] == 1.51 and host["top"][1] == {"name": "aten::copy_", "ms": 0.4, "count": 2}
    assert summary["CUDA runtime"]["top"] == [{"name": "cudaHostAlloc", "ms": 2.0, "count": 1}]
    assert summary["device"]["total_ms"] == 2.0 and summary["device"]["top"][0]["name"] == "Memcpy DtoH"
