"""The Mooncake transport against a real mooncake_master on 127.0.0.1: the published 02 folder, the key prefix a
stream owns, and a master that goes away (the stream's window and training through it: test_stream.py, which
runs over both transports; across processes with vLLM: test_stream_capture.py)."""

from __future__ import annotations

import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.capture import stream_mooncake
from eagle3_pipeline.capture.stream import CONSUMER, Consumer, open_transport, published_names
from eagle3_pipeline.capture.stream_producer import Producer
from eagle3_pipeline.config import load_config
from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.train import loop
from tests.capture.test_stream import streamed_tiny_run
from tests.conftest import CONFIGS
from tests.mooncake_master import mooncake_settings, running_master
from tests.train.fabricate import tiny_run
from tests.train.test_train_stage import LEARNED, records, torchrun_04

MASTER_GONE_WITHIN_S = 60  # docs/mooncake.md: the batch in flight, then the engine's shutdown


def config_for(tmp_path: Path, master: str, admin_port: int, *overrides: str):
    prefix = f"test-{uuid.uuid4().hex[:12]}"
    return load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path / 'run'}", "capture.mode=stream",
                                              *mooncake_settings(master, admin_port, prefix), *overrides])


def test_the_published_folder_arrives_whole_or_not_at_all(tmp_path, mooncake_master, monkeypatch):
    monkeypatch.setattr(stream_mooncake, "FILE_CHUNK_BYTES", 1000)  # several chunks per file
    config = config_for(tmp_path, *mooncake_master)
    source, copy = tmp_path / "source", tmp_path / "copy"
    source.mkdir()
    files = {"stream.json": b'{"stage": "02_hidden_states"}', "shard_00000.safetensors": bytes(range(256)) * 20,
             "index.json": b"{}"}
    for name, data in files.items():
        (source / name).write_bytes(data)
    publisher = open_transport(config, "stream-a", 1000, lend_bytes=1)
    reader = open_transport(config)
    assert reader.published() is None
    assert publisher.publish(source, sorted(files)) == sum(map(len, files.values()))

    listing = reader.published()
    assert listing["shard_00000.safetensors"]["chunks"] == 6
    reader.fetch(copy, listing)
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == files

    prefix = f"{config.capture.stream.mooncake.key_prefix}/files/shard_00000.safetensors"
    publisher._put(f"{prefix}/3", b"x" * 1000)
    with pytest.raises(StageError, match="shard_00000.safetensors does not match its hash"):
        reader.fetch(tmp_path / "copy2", listing)
    assert not (tmp_path / "copy2" / "shard_00000.safetensors").exists()
    publisher._remove(f"{prefix}/3")
    with pytest.raises(StageError, match=r"shard_00000.safetensors is incomplete \(chunk 3 missing\)"):
        reader.fetch(tmp_path / "copy3", listing)


def test_a_new_stream_owns_its_prefix_and_leaves_nothing_behind(tmp_path, mooncake_master):
    config = config_for(tmp_path, *mooncake_master)
    old, new = (open_transport(config, identity, 1000, lend_bytes=1) for identity in ("old-stream", "new-stream"))
    old.put(0, b"old")
    old.write_record(CONSUMER, {"next": 0})
    new.put(0, b"new")
    new.write_record("producer-0-of-1", {"state": "capturing"})
    assert old.get(0) == b"old" and new.get(0) == b"new"
    new.clear_other_streams()
    assert old.get(0) is None and old.read_record(CONSUMER) is None
    assert new.sizes() == {0: 3} and new.record_names() == ["producer-0-of-1"]
    new.end_stream()
    assert new.keys(config.capture.stream.mooncake.key_prefix + "/") == []


def test_a_master_that_goes_away_stops_both_sides_naming_it(tmp_path):
    """A capture job waiting for room and 04 waiting for an item both raise, naming the master, in seconds."""
    with running_master(tmp_path / "master.log") as (master, admin_port, process):
        config = config_for(tmp_path, master, admin_port, "capture.stream.poll_s=0.05",
                            "capture.stream.wait_timeout_s=600", "capture.stream.window_gb=0.000001")
        settings = config.capture.stream
        producer = Producer(open_transport(config, "s", 1000, lend_bytes=1), settings, 0, 1, identity=lambda: "s")
        consumer = Consumer(open_transport(config, "s", 1000), settings, "s")
        producer.put(0, b"x" * 1000, 1)  # the share (1,000 bytes) is full now; the store has the job's memory
        consumer.advance(0, 10, 1, 0)
        errors: dict[str, tuple[str, float]] = {}

        def side(name: str, wait) -> None:
            try:
                wait()
            except StageError as err:
                errors[name] = (str(err), time.monotonic())

        waiting = [threading.Thread(target=side, args=("02", lambda: producer.put(1, b"y" * 1000, 1))),
                   threading.Thread(target=side, args=("04", lambda: consumer.get(5)))]
        for thread in waiting:
            thread.start()
        time.sleep(1)
        assert not errors  # both are waiting on each other
        killed = time.monotonic()
        process.kill()
        for thread in waiting:
            thread.join(timeout=MASTER_GONE_WITHIN_S + 30)
    assert sorted(errors) == ["02", "04"]
    for message, when in errors.values():
        assert f"Mooncake master {master}" in message and "\n" not in message
        assert when - killed < MASTER_GONE_WITHIN_S
    print("stopped after", {name: round(when - killed, 1) for name, (_, when) in errors.items()}, "s")


@pytest.mark.slow
def test_two_trainer_processes_read_the_stream_from_mooncake_alone(tmp_path, mooncake_master):
    """04 under torchrun (2 processes) in a run folder holding only 01 and 03: it fetches 02's folder from the
    store, each rank reads its packs from it, and the curve is the one-process offline run's."""
    one, _ = tiny_run(tmp_path, "one", grad_accumulation=2)  # the same global batch: 2 packs a step
    loop.run(one)
    store = mooncake_settings(*mooncake_master, f"test-{uuid.uuid4().hex[:12]}")
    capture_side, item, _, transport = streamed_tiny_run(tmp_path, "capture-node", store, grad_accumulation=1)
    states_dir = capture_side.run_dir / "02_hidden_states"
    transport.publish(states_dir, published_names(states_dir))
    for position in range(2 * capture_side.train.max_steps):
        transport.put(position, item(position))

    trainer_dir = tmp_path / "trainer-node"
    for stage in ("01_data", "03_vocab"):
        shutil.copytree(capture_side.run_dir / stage, trainer_dir / stage)
    tree = capture_side.model_dump(mode="json", by_alias=True) | {"run_dir": str(trainer_dir)}
    (tmp_path / "trainer.yaml").write_text(yaml.safe_dump(tree))
    assert "2 process(es)" in torchrun_04(tmp_path / "trainer.yaml").stdout

    assert (trainer_dir / "02_hidden_states" / "stream.json").read_bytes() == (states_dir / "stream.json").read_bytes()
    for split in ("train", "eval"):
        want, got = records(one.run_dir, split), records(trainer_dir, split)
        assert sorted(got) == sorted(want) == list(range(1, capture_side.train.max_steps + 1)) if split == "train" \
            else sorted(got) == sorted(want)
        for step in want:
            for key in LEARNED:
                assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-5), (split, step, key)
    assert transport.sizes() == {} and transport.read_record(CONSUMER)["finished"]
