"""Stream mode (`capture.mode: stream`): 02 captures while 04 trains, the states waiting in a bounded window.

Stream positions are 04's pack stream (pack_plan.py, `PackStream`): position p is the p-th pack 04 trains on,
epoch after epoch, known from 01's sample lengths before any state exists. Capture job i of N produces the
positions p with p % N == i, in order, one item per pack (the states of its samples, as safetensors bytes);
04 reads position p, checks it against its own plan, trains, and deletes what it no longer needs. So a
streamed run trains on exactly the batches of an offline run, and each epoch is captured again.

Two small records coordinate the sides (the transport holds them beside the items):

    consumer          04's main process, after every step: the first position it still needs (`next`),
                      the end of the run, packs per step; `finished` at the end; `stream`, the identity of
                      the stream it reads (02's stream.json), so that a capture job never follows the record
                      of another run left in a reused folder
    producer-i-of-N   each capture job: its heartbeat, position and counters

Exactness under kills: 04 writes `next` before deleting the items below it, and a job lists the items present
before reading `next`, so a job never recaptures an item 04 has consumed. A resumed 04 writes a smaller `next`
(its checkpoint's position): the jobs then capture again what it had deleted since, first in line, deleting
items of later positions they hold when their share is full (04 reads in order; those are captured again).

Window: each job (`Producer`, stream_producer.py) keeps the bytes of its own items (the one being written
included) within `window_gb / num_shards`, so all jobs together never hold more than `window_gb`.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from safetensors.torch import load as load_bytes

from eagle3_pipeline.capture import store
from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.config_sections import StreamConfig
from eagle3_pipeline.stage_io import MANIFEST, StageError

CONSUMER = "consumer"
FIRST_POLL_S = 0.001  # a waiting side looks again after this, then after twice as long, up to poll_s
FIRST_MESSAGE_AFTER_S = 5.0  # a wait shorter than this is routine and says nothing
MESSAGE_EVERY_S = 60.0


class StreamTimeout(StageError):
    """The other side made no progress for `capture.stream.wait_timeout_s`."""

    leaves_checkpoint = True


ITEM_HEADER_BYTES = 4096  # an item's safetensors header and metadata, at most (estimates only)


def largest_item_bytes(config: RunConfig, per_token: int) -> int:
    """An upper bound of one item's size: a pack holds at most packed_length rows, and each sample has one
    token more than its rows (at least one row)."""
    return 2 * config.train.packed_length * per_token + ITEM_HEADER_BYTES


# ------------------------------------------------------------------------------------------- transport
class Transport(Protocol):
    """Where items and records live between the two sides; an item is visible only once complete. A transport is
    one module implementing this, named in `TRANSPORTS`; capture.py and 04's loop use only these methods."""

    shares_folder: ClassVar[bool]  # every side sees the same run_dir: 02's folder is not published and fetched

    @classmethod
    def open(cls, config: RunConfig, identity: str | None, item_bytes: int, lend_bytes: int) -> Transport: ...
    @staticmethod
    def lend_bytes(settings: StreamConfig, share_bytes: int, published_bytes: int) -> int: ...  # a capture job's
    @staticmethod
    def window_in_stage_folder(settings: StreamConfig) -> bool: ...  # 02's disk plan counts the window there
    def put(self, position: int, data: bytes) -> None: ...
    def get(self, position: int) -> bytes | None: ...
    def delete(self, position: int) -> None: ...
    def sizes(self) -> dict[int, int]: ...  # position -> bytes held, items being written included
    def discard_partial(self, shard_index: int, num_shards: int) -> None: ...
    def write_record(self, name: str, record: dict) -> None: ...
    def read_record(self, name: str) -> dict | None: ...
    def record_names(self) -> list[str]: ...
    def describe(self) -> str: ...  # where the stream passes, for messages
    def end_stream(self) -> None: ...  # every side has finished: let go of what the stream holds
    def clear_other_streams(self) -> None: ...  # a stream opened afresh owns the transport's space
    def publish(self, folder: Path, names: list[str]) -> int: ...  # put 02's files for the other nodes; bytes
    def published(self) -> dict | None: ...  # their listing (name -> chunks, bytes, sha256), None before
    def fetch(self, folder: Path, listing: dict) -> None: ...  # write them into this node's folder
    def close(self) -> None: ...


# Which transport each `capture.stream.transport` names: a module and class implementing `Transport`.
TRANSPORTS = {
    "directory": "eagle3_pipeline.capture.stream_directory.DirectoryTransport",
    "mooncake": "eagle3_pipeline.capture.stream_mooncake.MooncakeTransport",
}


def transport_class(config: RunConfig) -> type[Transport]:
    """The class of the configured transport (imported only when chosen: Mooncake's client is optional)."""
    module, _, name = TRANSPORTS[config.capture.stream.transport].rpartition(".")
    return getattr(importlib.import_module(module), name)


def open_transport(config: RunConfig, identity: str | None = None, item_bytes: int = 0,
                   lend_bytes: int = 0) -> Transport:
    """The configured transport, tied to one stream (`identity`; None reads the published files only), moving
    objects of up to `item_bytes`, lending the store `lend_bytes` of this process's memory where it has one."""
    return transport_class(config).open(config, identity, item_bytes, lend_bytes)


def shares_folder(config: RunConfig) -> bool:
    """True when every side of the stream sees the same run_dir; otherwise 02's folder reaches the other nodes
    through the transport (job 0 publishes it, `fetch_folder` writes it elsewhere)."""
    return transport_class(config).shares_folder


def published_names(stage_dir: Path) -> list[str]:
    """What 02 hands the other nodes: its folder as the stream opened it (header, eval shards, index)."""
    return sorted(p.name for p in stage_dir.iterdir() if p.is_file() and not p.name.startswith(".")
                  and p.name != MANIFEST and ".tmp" not in p.name)


def fetch_folder(config: RunConfig, stage_dir: Path, who: str) -> None:
    """Wait until 02's job 0 has published its folder in the Mooncake store, then write it into `stage_dir`."""
    transport = open_transport(config)
    try:
        listing = Waiter(config.capture.stream, who).wait(
            transport.published, lambda: f"waiting for 02_generate_hidden_states.py job 0 to open its stream in "
            f"{transport.describe()}", lambda: None, "start 02_generate_hidden_states.py (job 0) with this config")
        stage_dir.mkdir(parents=True, exist_ok=True)
        transport.fetch(stage_dir, listing)
        print(f"{who}: fetched 02's stream header and eval states ({len(listing)} files, "
              f"{sum(e['bytes'] for e in listing.values()) / 1e6:.1f} MB) from {transport.describe()}", flush=True)
    finally:
        transport.close()


# ------------------------------------------------------------------------------------------------ items
@dataclass(frozen=True)
class PackItem:
    position: int
    epoch: int
    samples: list[store.SampleStates]


def encode_item(item: PackItem, dtype: str) -> bytes:
    """One pack's states as safetensors bytes; the metadata names the position, epoch and samples."""
    metadata = {"position": str(item.position), "epoch": str(item.epoch),
                "samples": json.dumps([[s.sample_id, s.final.shape[0]] for s in item.samples])}
    return store.safetensors_bytes(store.encode_states(item.samples, dtype), metadata)


def decode_item(data: bytes, position: int, expected: list[tuple[str, int]], num_aux: int, hidden_size: int,
                dtype: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(aux, final) per sample of the item at `position`, checked against the plan's (sample id, tokens);
    a corrupt, truncated or mismatched item raises StageError naming its samples, before anything trains on it."""
    names = ", ".join(sample_id for sample_id, _ in expected)
    try:
        header_length = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8: 8 + header_length]).get("__metadata__", {})
        tensors = load_bytes(data)
        problem = None
        if int(metadata["position"]) != position or [tuple(s) for s in json.loads(metadata["samples"])] != expected:
            problem = f"it holds position {metadata['position']}, samples {metadata['samples']}"
    except Exception as err:  # whatever a truncated or corrupt file makes the parser raise
        tensors, problem = None, f"unreadable ({type(err).__name__}: {err})"
    problem = problem or store.check_tensors(tensors, sum(t for _, t in expected), num_aux, hidden_size, dtype)
    if problem:
        raise StageError(f"stream position {position} (samples {names}): {problem}; not trained on. Delete the "
                         f"item and rerun 02_generate_hidden_states.py to capture it again")
    offsets = [0]
    for _, tokens in expected:
        offsets.append(offsets[-1] + tokens)
    return [store.decode_rows(tensors, slice(a, b)) for a, b in zip(offsets, offsets[1:])]


# ---------------------------------------------------------------------------------------------- waiting
class Waiter:
    """Polls until a condition holds, says now and then what it waits for, and gives up when the other side
    shows no progress for `wait_timeout_s` (any change of `progress()` restarts that clock). The looks start
    FIRST_POLL_S apart and the pause doubles up to `poll_s`: a wait of a few ms (04 on the GPU trains a pack in
    ~44 ms) ends within a few ms, a long one costs few looks."""

    def __init__(self, settings: StreamConfig, who: str):
        self.settings, self.who = settings, who
        self.waited_s = 0.0

    def wait(self, ready, describe, progress, on_timeout: str):
        """`ready()` returns a value when done, else None; `describe()` says what is awaited."""
        started = last_message = last_progress = time.monotonic()
        marker = progress()
        pause = min(FIRST_POLL_S, self.settings.poll_s)
        try:
            while True:
                value = ready()
                if value is not None:
                    return value
                now, seen = time.monotonic(), progress()
                if seen != marker:
                    marker, last_progress = seen, now
                if now - last_progress >= self.settings.wait_timeout_s:
                    raise StreamTimeout(f"{describe()}; no progress for {self.settings.wait_timeout_s:.0f} s "
                                        f"(capture.stream.wait_timeout_s): {on_timeout}")
                if now - started >= FIRST_MESSAGE_AFTER_S and (last_message == started or
                                                                now - last_message >= MESSAGE_EVERY_S):
                    print(f"{self.who}: {describe()} (waiting {now - started:.0f} s)", file=sys.stderr, flush=True)
                    last_message = now
                time.sleep(pause)
                pause = min(2 * pause, self.settings.poll_s)
        finally:
            self.waited_s += time.monotonic() - started


# --------------------------------------------------------------------------------------------- consumer
class Consumer:
    """04's side: items by position (in any process, data loader workers included) and, in the main process,
    the record that tells the capture jobs where 04 is."""

    def __init__(self, transport: Transport, settings: StreamConfig, identity: str):
        self.transport, self.settings, self.identity = transport, settings, identity
        self.waiter = Waiter(settings, "04_train")

    def _producers(self):
        return tuple((name, (self.transport.read_record(name) or {}).get("time"))
                     for name in self.transport.record_names() if name != CONSUMER)

    def _describe(self, position: int) -> str:
        now, seen = time.time(), []
        for name in self.transport.record_names():
            record = self.transport.read_record(name) or {}
            if name != CONSUMER:
                seen.append(f"{name}: {record.get('state', '?')}, last seen {now - record.get('time', now):.0f} s ago")
        jobs = "; ".join(seen) or "no capture job has reported yet"
        return f"waiting for 02_generate_hidden_states to capture stream position {position} ({jobs})"

    def get(self, position: int) -> bytes:
        return self.waiter.wait(lambda: self.transport.get(position), lambda: self._describe(position),
                                self._producers,
                                "start or rerun 02_generate_hidden_states.py (it resumes), then 04_train.py --resume")

    def advance(self, next_position: int, end: int, packs_per_step: int, step: int) -> None:
        """Tell the capture jobs the first position still needed, then delete the items below it."""
        self.transport.write_record(CONSUMER, {"next": next_position, "end": end, "packs_per_step": packs_per_step,
                                               "step": step, "time": time.time(), "pid": os.getpid(),
                                               "stream": self.identity})
        for position in self.transport.sizes():
            if position < next_position:
                self.transport.delete(position)

    def finish(self, end: int, packs_per_step: int, step: int) -> None:
        self.transport.write_record(CONSUMER, {"next": end, "end": end, "packs_per_step": packs_per_step,
                                               "step": step, "time": time.time(), "finished": True,
                                               "stream": self.identity})
        for position in self.transport.sizes():
            self.transport.delete(position)
