"""engine.py without an engine: the order a capturer's two halves run in, and which capture path `auto` takes."""

from __future__ import annotations

import threading
import time

import pytest

from eagle3_pipeline.capture import engine
from eagle3_pipeline.capture.engine import CaptureSeconds, OverlappedCapture, choose_method


class Recorded(OverlappedCapture):
    """Prefill and collect that log when they start and end; collect is slow, so an overlap shows."""

    def __init__(self, fail_on: int | None = None):
        self.log: list[str] = []
        self.seconds = CaptureSeconds()
        self.lock = threading.Lock()
        self.fail_on = fail_on

    def note(self, what: str) -> None:
        with self.lock:
            self.log.append(what)

    def _prefill(self, prompts):
        self.note(f"prefill {prompts[0]} start")
        time.sleep(0.05)
        self.note(f"prefill {prompts[0]} end")
        return prompts[0]

    def _collect(self, batch):
        self.note(f"collect {batch} start")
        time.sleep(0.1)
        if batch == self.fail_on:
            raise RuntimeError(f"batch {batch}: unreadable")
        self.note(f"collect {batch} end")
        return [batch * 10]


def test_each_batch_is_collected_while_the_next_is_prefilled_and_before_the_one_after():
    capturer = Recorded()
    assert list(capturer.capture_batches([[0], [1], [2]])) == [[0], [10], [20]]
    log = capturer.log
    # batch 0's collect overlaps batch 1's prefill: it starts before that prefill ends
    assert log.index("collect 0 start") < log.index("prefill 1 end")
    # and it ends before batch 2's prefill starts (two banks of slabs: the third prefill reuses batch 0's)
    assert log.index("collect 0 end") < log.index("prefill 2 start")
    # three prefills of 0.05 s and three collects of 0.1 s; the waits hide at most the first two collects' overlap
    seconds = capturer.seconds
    assert 0.15 <= seconds.prefill < 0.3 and 0.3 <= seconds.collect < 0.45
    assert 0.1 <= seconds.waited < seconds.collect - 0.05  # the last collect is waited for whole; the others in part
    assert capturer.capture([5]) == [50]


def test_a_failed_collect_stops_the_capture_with_its_error():
    capturer = Recorded(fail_on=1)
    with pytest.raises(RuntimeError, match="batch 1: unreadable"):
        list(capturer.capture_batches([[0], [1], [2], [3]]))
    assert "prefill 3 start" not in capturer.log


def test_a_none_in_the_batches_hands_over_the_batch_in_flight_first():
    """Stream mode's batches wait on room that the batch in flight frees once handed over: a None from the
    batches delivers it before the next batch is asked for."""
    capturer, delivered = Recorded(), []

    def batches():
        yield [0]
        yield None
        assert delivered == [[0]]  # batch 0 handed over before batch 1 is made
        yield [1]

    for states in capturer.capture_batches(batches()):
        delivered.append(states)
    assert delivered == [[0], [10]] and capturer.log.count("prefill 1 start") == 1


def test_auto_takes_extract_hidden_states_for_a_dense_target_on_cpu_and_the_worker_extension_on_a_gpu(monkeypatch):
    dense, mla = {"num_hidden_layers": 30}, {"num_hidden_layers": 8, "kv_lora_rank": 512}
    monkeypatch.setattr(engine, "vllm_version", lambda: engine.FIRST_VLLM_WITH_EXTRACTION)
    monkeypatch.setattr(engine, "on_cpu", lambda: True)
    assert choose_method("auto", dense) == "extract_hidden_states"
    assert choose_method("auto", mla) == "worker_extension"
    monkeypatch.setattr(engine, "on_cpu", lambda: False)
    assert choose_method("auto", dense) == "worker_extension"
    assert choose_method("extract_hidden_states", dense) == "extract_hidden_states"  # named: as named
