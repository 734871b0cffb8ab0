"""Stream mode without vLLM: the stream's items, the window of a capture job, and 04 as the consumer of a
stream written here from fabricated states (tiny target), against the same run done offline."""

from __future__ import annotations

import json
import threading
import time
import typing
import uuid
from pathlib import Path

import datasets
import pytest
import torch

from eagle3_pipeline.capture.store import SampleStates
from eagle3_pipeline.capture import stream as stream_module
from eagle3_pipeline.capture.stream import (
    CONSUMER,
    TRANSPORTS,
    PackItem,
    Transport,
    Waiter,
    decode_item,
    encode_item,
    open_transport,
    transport_class,
)
from eagle3_pipeline.capture.stream_producer import Producer
from eagle3_pipeline.config import RunConfig, apply_overrides, load_config, parse_config
from eagle3_pipeline.config_sections import StreamConfig
from eagle3_pipeline.pack_plan import run_pack_stream
from eagle3_pipeline.stage_io import StageError, read_manifest, stream_identity
from eagle3_pipeline.stand_ins.fabricated_stages import write_data_stage, write_states_stage
from eagle3_pipeline.train import loop
from tests.conftest import CONFIGS
from tests.mooncake_master import mooncake_settings
from tests.train.fabricate import (
    TINY,
    random_samples,
    random_states,
    tiny_run,
    tiny_run_config,
    tiny_target,
    write_vocab_stage,
)

STREAM = {"mode": "stream", "stream": {"window_gb": 0.001, "wait_timeout_s": 3, "poll_s": 0.05}}


@pytest.fixture(params=["directory", "mooncake"])
def through(request) -> list[str]:
    """`--set` overrides choosing the transport: a folder, or a Mooncake store on 127.0.0.1 (one key prefix per
    test: the tests share the session's master)."""
    if request.param == "directory":
        return []
    master, admin_port = request.getfixturevalue("mooncake_master")
    return mooncake_settings(master, admin_port, f"test-{uuid.uuid4().hex[:12]}")


def with_overrides(config: RunConfig, overrides: list[str]) -> RunConfig:
    tree = config.model_dump(mode="json", by_alias=True)
    apply_overrides(tree, overrides)
    return parse_config(tree, "test")


def states(count: int, tokens: int = 5) -> list[SampleStates]:
    return [SampleStates(f"s{i}", torch.randn(tokens, 3, 8), torch.randn(tokens, 8)) for i in range(count)]


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_an_item_decodes_to_its_samples_states(dtype):
    samples = states(3)
    data = encode_item(PackItem(7, 1, samples), dtype)
    got = decode_item(data, 7, [(s.sample_id, 5) for s in samples], 3, 8, dtype)
    for sample, (aux, final) in zip(samples, got):
        tolerance = 0.07 if dtype == "fp8" else 0.01
        assert torch.allclose(aux.float(), sample.aux, rtol=tolerance, atol=tolerance)
        assert torch.allclose(final.float(), sample.final, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("damage, problem", [
    (lambda data: data[: len(data) // 2], "unreadable"),
    (lambda data: data[:100], "unreadable"),
    (lambda data: b"", "unreadable"),
])
def test_a_damaged_item_fails_naming_its_samples(damage, problem):
    samples = states(2)
    data = damage(encode_item(PackItem(4, 0, samples), "bfloat16"))
    with pytest.raises(StageError, match=rf"stream position 4 \(samples s0, s1\): {problem}.*not trained on"):
        decode_item(data, 4, [("s0", 5), ("s1", 5)], 3, 8, "bfloat16")


def test_an_item_of_other_samples_or_shapes_is_refused():
    data = encode_item(PackItem(4, 0, states(2)), "bfloat16")
    with pytest.raises(StageError, match="samples s0, s9.*it holds position 4"):
        decode_item(data, 4, [("s0", 5), ("s9", 5)], 3, 8, "bfloat16")
    with pytest.raises(StageError, match="position 5 .*it holds position 4"):
        decode_item(data, 5, [("s0", 5), ("s1", 5)], 3, 8, "bfloat16")
    with pytest.raises(StageError, match=r"aux is \(10, 3, 8\).*expected \(10, 2, 8\)"):
        decode_item(data, 4, [("s0", 5), ("s1", 5)], 2, 8, "bfloat16")
    nan = states(1)
    nan[0].aux[2, 1, 3] = float("nan")
    with pytest.raises(StageError, match="aux holds non-finite values"):
        decode_item(encode_item(PackItem(0, 0, nan), "bfloat16"), 0, [("s0", 5)], 3, 8, "bfloat16")


def test_a_capture_job_never_holds_more_than_its_share(tmp_path, through):
    """Two jobs share a window of 10 items' bytes; 04 consumes slowly; every put keeps each job in its half."""
    config = load_config(CONFIGS / "demo.yaml", [
        f"run_dir={tmp_path}", "capture.stream.poll_s=0.01", "capture.stream.wait_timeout_s=20", *through])
    item = encode_item(PackItem(0, 0, states(1)), "bfloat16")
    window = 10 * len(item)
    settings = config.capture.stream.model_copy(update={"window_gb": window / 1e9})
    transport = open_transport(config, "stream-a", len(item), lend_bytes=4 * window)
    end, peak = 40, [0]

    def job(index: int) -> None:
        producer = Producer(transport, settings, index, 2, identity=lambda: "stream-a")
        while positions := producer.next_positions(lambda p: (p,), lambda pack: len(item), 3):
            for position in positions:
                producer.put(position, item, 5)
                peak[0] = max(peak[0], sum(transport.sizes().values()))
        producer.finish()

    jobs = [threading.Thread(target=job, args=(i,)) for i in range(2)]
    for thread in jobs:
        thread.start()
    from eagle3_pipeline.capture.stream import Consumer

    consumer, seen = Consumer(transport, settings, identity="stream-a"), []
    for position in range(end):
        consumer.advance(position, end, 1, position)
        assert sum(transport.sizes().values()) <= window
        seen.append(consumer.get(position))
        time.sleep(0.005)
    consumer.finish(end, 1, end)
    for thread in jobs:
        thread.join(timeout=30)
    assert len(seen) == end and all(data == item for data in seen)
    assert 0 < peak[0] <= window and transport.sizes() == {}
    records = [transport.read_record(f"producer-{i}-of-2") for i in range(2)]
    assert [r["state"] for r in records] == ["finished"] * 2
    assert sum(r["packs"] for r in records) >= end  # each position at least once (a few past the end are dropped)
    assert all(r["max_held_bytes"] <= window // 2 for r in records)


# ---------------------------------------------------------------------------- 04 as the stream's consumer
def streamed_tiny_run(tmp_path: Path, name: str, through: list[str] = (), **train: object):
    """tiny_run's 01 and 03 and states, with 02 as an open stream whose eval split is in shards; returns
    (config, stream positions -> item bytes, the pack stream, 02's side of the transport)."""
    target = tmp_path / "target"
    if not (target / "config.json").exists():
        tiny_target(target)
    config, _ = tiny_run_config(tmp_path / name, target, capture=STREAM, **train)
    config = with_overrides(config, list(through))
    train_samples = random_samples(24, TINY["vocab"], seed=1, prefix="t")
    eval_samples = random_samples(6, TINY["vocab"], seed=2, prefix="e")
    write_data_stage(config, train_samples, eval_samples, TINY["vocab"])
    all_states = random_states(train_samples + eval_samples, len(TINY["aux_layer_ids"]), TINY["hidden"], seed=3)
    write_vocab_stage(config)
    write_states_stage(config, all_states, TINY["aux_layer_ids"])  # stream mode: eval shards, stream opened

    packs = run_pack_stream(config, [len(s["input_ids"]) for s in train_samples])

    def item(position: int) -> bytes:
        epoch, _ = packs.locate(position)
        return encode_item(PackItem(position, epoch, [all_states[i] for i in packs.pack(position)]), "bfloat16")

    return config, item, packs, open_transport(config, stream_identity(config.run_dir / "02_hidden_states"), 1 << 20,
                                                  lend_bytes=64 << 20)


def train_records(run_dir: Path, split: str = "train") -> dict[int, dict]:
    lines = (run_dir / "04_train" / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines) if r["split"] == split}


def test_streamed_training_equals_offline_and_resumes_after_a_timeout(tmp_path, through):
    """04 waits for a stream that stops at position 5, exits 1 naming 02 with a checkpoint of step 5; with the
    rest of the stream put, --resume finishes with every step's loss bit-equal to the offline run's."""
    offline, _ = tiny_run(tmp_path, "offline")
    loop.run(offline)
    config, item, _, transport = streamed_tiny_run(tmp_path, "streamed", through)
    for position in range(5):
        transport.put(position, item(position))
    started = time.monotonic()
    with pytest.raises(StageError, match=r"02_generate_hidden_states to capture stream position 5 .*no progress "
                                         r"for 3 s.*checkpoint: step 5"):
        loop.run(config)
    assert time.monotonic() - started < 60
    assert (config.run_dir / "04_train" / "checkpoints" / "step_5").is_dir()
    assert transport.read_record(CONSUMER)["next"] == 5 and transport.sizes() == {}  # consumed and deleted

    end = config.train.max_steps
    for position in range(5, end):
        transport.put(position, item(position))
    loop.run(config, resume=True)
    want, got = train_records(offline.run_dir), train_records(config.run_dir)
    keys = ("loss_0", "acc_0", "loss_1", "acc_1", "loss_2", "acc_2", "grad_norm")
    assert sorted(got) == sorted(want) == list(range(1, end + 1))
    for step in want:
        assert {k: got[step][k] for k in keys} == {k: want[step][k] for k in keys}, step
    assert train_records(config.run_dir, "eval") == train_records(offline.run_dir, "eval")
    assert train_records(config.run_dir, "batch") == train_records(offline.run_dir, "batch")
    assert transport.read_record(CONSUMER)["finished"] and transport.sizes() == {}
    assert read_manifest(config.run_dir / "04_train") is not None


def test_a_corrupt_item_stops_training_before_its_step(tmp_path):
    config, item, packs, transport = streamed_tiny_run(tmp_path, "corrupt")
    for position in range(config.train.max_steps):
        data = item(position)
        transport.put(position, data[: len(data) - 40] if position == 3 else data)
    train = datasets.load_from_disk(str(config.run_dir / "01_data" / "train"))
    samples = ", ".join(train.select(packs.pack(3))["id"])
    with pytest.raises(StageError, match=rf"stream position 3 \(samples {samples}\): unreadable.*not trained on"):
        loop.run(config)
    assert sorted(train_records(config.run_dir)) == [1, 2, 3]  # steps 1-3 read positions 0-2; step 4 never ran


def test_a_capture_job_ignores_the_record_of_another_run_in_a_reused_folder(tmp_path):
    config = load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path}"])
    transport = open_transport(config)
    transport.write_record(CONSUMER, {"next": 50, "end": 60, "finished": True, "time": 0, "stream": "old-run"})
    producer = Producer(transport, config.capture.stream, 0, 1, identity=lambda: "this-run")
    assert producer.next_positions(lambda p: (p,), lambda pack: 100, 3) == [0, 1, 2]
    transport.write_record(CONSUMER, {"next": 50, "end": 60, "finished": True, "time": 0, "stream": "this-run"})
    assert producer.next_positions(lambda p: (p,), lambda pack: 100, 3) == []


def test_after_04_rewinds_the_missing_positions_go_first_even_in_a_full_window(tmp_path, through):
    """04 resumed at position 4 while the job's share is full with positions 6 and 7: the job makes room by
    deleting its latest items, so 4 and 5 come first (a job waiting for room here would wait forever)."""
    config = load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path}", *through])
    transport = open_transport(config, "run", 1 << 10, lend_bytes=1 << 20)
    settings = config.capture.stream.model_copy(update={"window_gb": 200 / 1e9})  # room for two 100-byte items
    producer = Producer(transport, settings, 0, 1, identity=lambda: "run")
    for position in (6, 7):
        transport.put(position, b"x" * 100)
    transport.write_record(CONSUMER, {"next": 4, "end": 12, "packs_per_step": 1, "time": 1, "stream": "run"})
    assert producer.next_positions(lambda p: (p,), lambda pack: 100, 4) == [4]
    producer.put(4, b"x" * 100, 1)
    assert sorted(transport.sizes()) == [4, 6]
    assert producer.next_positions(lambda p: (p,), lambda pack: 100, 4) == [5]
    producer.put(5, b"x" * 100, 1)
    assert sorted(transport.sizes()) == [4, 5]


def test_a_batch_in_flight_is_not_chosen_again_and_holds_its_room(tmp_path, through):
    """02 asks for its next batch while the one before is still being captured (capture_batches): those positions
    are reserved until put and counted against the share, and an ask without waiting answers None where only
    that batch's put (and 04 reading it) can make room."""
    config = load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path}", *through])
    transport = open_transport(config, "run", 1 << 10, lend_bytes=1 << 20)
    settings = config.capture.stream.model_copy(update={"window_gb": 300 / 1e9})  # room for three 100-byte items
    producer = Producer(transport, settings, 0, 1, identity=lambda: "run")
    transport.write_record(CONSUMER, {"next": 0, "end": 12, "packs_per_step": 1, "time": 1, "stream": "run"})

    def ask(wait: bool):
        return producer.next_positions(lambda p: (p,), lambda pack: 100, 2, wait=wait)

    assert ask(wait=True) == [0, 1]
    assert ask(wait=False) == [2]
    assert ask(wait=False) is None  # the share is reserved whole
    for position in (0, 1):
        producer.put(position, b"x" * 100, 1)
    assert ask(wait=False) is None  # held now, until 04 reads them
    transport.write_record(CONSUMER, {"next": 2, "end": 12, "packs_per_step": 1, "time": 2, "stream": "run"})
    assert ask(wait=False) == [3, 4]  # 0 and 1 read (deleted); 2 still in flight
    producer.put(2, b"x" * 100, 1)
    assert sorted(transport.sizes()) == [2] and ask(wait=False) is None


def test_room_ahead_lets_02_capture_past_a_full_window_while_the_window_still_bounds_what_is_put(tmp_path):
    """capture.stream.ahead_gb: 02 chooses positions beyond the window's free room (their states wait in its host
    memory), and their put still waits until the window has room for them."""
    config = load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path}"])
    transport = open_transport(config, "run", 1 << 10, lend_bytes=1 << 20)
    settings = config.capture.stream.model_copy(update={"window_gb": 300 / 1e9, "ahead_gb": 200 / 1e9,
                                                        "wait_timeout_s": 60.0, "poll_s": 0.01})
    producer = Producer(transport, settings, 0, 1, identity=lambda: "run")
    transport.write_record(CONSUMER, {"next": 0, "end": 12, "packs_per_step": 1, "time": 1, "stream": "run"})

    def ask():
        return producer.next_positions(lambda p: (p,), lambda pack: 100, 2, wait=False)

    assert [ask(), ask(), ask(), ask()] == [[0, 1], [2, 3], [4], None]  # 3 items of window and 2 ahead
    for position in (0, 1, 2):
        producer.put(position, b"x" * 100, 1)
    writer = threading.Thread(target=producer.put, args=(3, b"x" * 100, 1))
    writer.start()
    time.sleep(0.2)
    assert writer.is_alive() and sorted(transport.sizes()) == [0, 1, 2]  # the window is full: 3 waits
    transport.write_record(CONSUMER, {"next": 1, "end": 12, "packs_per_step": 1, "time": 2, "stream": "run"})
    writer.join(timeout=5)
    assert not writer.is_alive() and sorted(transport.sizes()) == [1, 2, 3]
    assert [ask(), ask()] == [[5], None]  # 3 held, 4 and 5 ahead
    transport.write_record(CONSUMER, {"next": 2, "end": 12, "packs_per_step": 1, "time": 3, "stream": "run"})
    assert ask() == [6] and producer.counts["max_held_bytes"] == 300


def test_a_put_waiting_for_room_keeps_its_reservation_and_stops_once_the_capture_is_cancelled(tmp_path):
    """02's writer thread puts a batch while the engine's thread asks for the next: a put that waits for room
    still holds its position's reservation (the other thread neither chooses it again nor counts its room free),
    and `cancel` (02 failed elsewhere) ends that wait at once instead of after wait_timeout_s."""
    config = load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path}"])
    transport = open_transport(config, "run", 1 << 10, lend_bytes=1 << 20)
    settings = config.capture.stream.model_copy(update={"window_gb": 300 / 1e9, "wait_timeout_s": 60.0})
    producer = Producer(transport, settings, 0, 1, identity=lambda: "run")
    transport.write_record(CONSUMER, {"next": 0, "end": 12, "packs_per_step": 1, "time": 1, "stream": "run"})
    assert producer.next_positions(lambda p: (p,), lambda pack: 100, 3) == [0, 1, 2]
    for position in (0, 1):
        producer.put(position, b"x" * 100, 1)
    failure: list[BaseException] = []

    def put_too_large():
        try:
            producer.put(2, b"x" * 150, 1)  # 200 held + 150 > 300: waits for 04
        except StageError as err:
            failure.append(err)

    writer = threading.Thread(target=put_too_large)
    writer.start()
    time.sleep(0.3)
    assert writer.is_alive() and producer.next_positions(lambda p: (p,), lambda pack: 100, 3, wait=False) is None
    started = time.monotonic()
    producer.cancel()
    writer.join(timeout=5)
    assert not writer.is_alive() and time.monotonic() - started < 2
    assert "stream position 2: not put, the capture stopped" in str(failure[0])
    assert sorted(transport.sizes()) == [0, 1]


def test_a_waiting_side_looks_again_after_1_ms_then_doubles_the_pause_up_to_poll_s(monkeypatch):
    """04 on a GPU trains a pack in ~44 ms: an item that lands a few ms after a miss must be seen a few ms later,
    not after a whole poll_s (0.2 s), while a long wait still looks only every poll_s."""
    pauses: list[float] = []
    monkeypatch.setattr(stream_module.time, "sleep", pauses.append)
    looks = iter([None] * 11 + ["item"])
    waiter = Waiter(StreamConfig(poll_s=0.2, wait_timeout_s=60), "04_train")
    assert waiter.wait(lambda: next(looks), lambda: "position 0", lambda: 0, "rerun") == "item"
    assert pauses == [0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.2, 0.2, 0.2]


def test_every_transport_the_config_names_is_registered_and_implements_the_interface():
    """A transport is one module behind `stream.Transport`: the config's choices and the registry agree, and each
    registered class has every member the interface names."""
    kinds = typing.get_args(StreamConfig.model_fields["transport"].annotation)
    assert set(TRANSPORTS) == set(kinds)
    members = set(Transport.__annotations__) | {n for n in vars(Transport) if not n.startswith("_")}
    assert {"open", "put", "publish", "fetch", "close", "shares_folder", "lend_bytes"} <= members
    for kind in kinds:
        config = load_config(CONFIGS / "demo.yaml", ["run_dir=/tmp/unused", f"capture.stream.transport={kind}"])
        cls = transport_class(config)
        assert not [m for m in members if not hasattr(cls, m)], (kind, [m for m in members if not hasattr(cls, m)])
