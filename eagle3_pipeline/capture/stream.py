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

Window: each job keeps the bytes of its own items (the one being written included) within
`window_gb / num_shards`, so all jobs together never hold more than `window_gb`.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import torch
from safetensors.torch import load as load_bytes
from safetensors.torch import save as save_bytes

from eagle3_pipeline.capture import store
from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.config_sections import StreamConfig
from eagle3_pipeline.stage_io import MANIFEST, StageError

CONSUMER = "consumer"
FIRST_MESSAGE_AFTER_S = 5.0  # a wait shorter than this is routine and says nothing
MESSAGE_EVERY_S = 60.0


class StreamTimeout(StageError):
    """The other side made no progress for `capture.stream.wait_timeout_s`."""


ITEM_HEADER_BYTES = 4096  # an item's safetensors header and metadata, at most (estimates only)


def producer_record(shard_index: int, num_shards: int) -> str:
    return f"producer-{shard_index}-of-{num_shards}"


def share_bytes(settings: StreamConfig, num_shards: int) -> int:
    """The part of the window one of `num_shards` capture jobs may fill."""
    return int(settings.window_gb * 1e9) // num_shards


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
    return save_bytes(store.encode_states(item.samples, dtype), metadata=metadata)


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
    shows no progress for `wait_timeout_s` (any change of `progress()` restarts that clock)."""

    def __init__(self, settings: StreamConfig, who: str):
        self.settings, self.who = settings, who
        self.waited_s = 0.0

    def wait(self, ready, describe, progress, on_timeout: str):
        """`ready()` returns a value when done, else None; `describe()` says what is awaited."""
        started = last_message = last_progress = time.monotonic()
        marker = progress()
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
                time.sleep(self.settings.poll_s)
        finally:
            self.waited_s += time.monotonic() - started


# --------------------------------------------------------------------------------------------- producer
class Producer:
    """One capture job's side: which positions to capture next, and putting them within its share.
    `identity()` is the stream's identity once 02 has opened it, else None."""

    def __init__(self, transport: Transport, settings: StreamConfig, shard_index: int, num_shards: int, identity):
        self.transport, self.shard_index, self.num_shards = transport, shard_index, num_shards
        self.identity = identity
        self.share = share_bytes(settings, num_shards)
        self.name = producer_record(shard_index, num_shards)
        self.waiter = Waiter(settings, f"02_hidden_states job {shard_index}/{num_shards}")
        self.counts = {"packs": 0, "tokens": 0, "bytes": 0, "max_held_bytes": 0}
        self._beat_at = 0.0
        transport.discard_partial(shard_index, num_shards)

    def _mine(self, position: int) -> bool:
        return position % self.num_shards == self.shard_index

    def _look(self) -> tuple[dict[int, int], dict]:
        """(own items held, consumer record), listed in that order (see the module docstring); own items
        below the consumer's `next` are deleted on the way (04 deletes them too; whoever comes first)."""
        sizes = {p: n for p, n in self.transport.sizes().items() if self._mine(p)}
        consumer = self._consumer()
        for position in [p for p in sizes if p < consumer.get("next", 0)]:
            self.transport.delete(position)
            del sizes[position]
        return sizes, consumer

    def beat(self, state: str, force: bool = False) -> None:
        if force or time.monotonic() - self._beat_at >= 1.0:
            self.transport.write_record(self.name, {
                "state": state, "time": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                "share_bytes": self.share, "waited_s": round(self.waiter.waited_s, 3), **self.counts})
            self._beat_at = time.monotonic()

    def _consumer(self) -> dict:
        """04's record, when it is about this stream (04 starts only once the stream is open)."""
        record = self.transport.read_record(CONSUMER) or {}
        return record if record.get("stream") is not None and record.get("stream") == self.identity() else {}

    def _consumer_progress(self):
        record = self._consumer()
        return record.get("next"), record.get("time")

    def next_positions(self, pack_of, bytes_of, max_samples: int) -> list[int]:
        """The next positions this job captures, in order, as many as fit its free share (and `max_samples`
        samples); waits while none does; [] once 04 has finished. `pack_of(p)` gives the sample indices of
        position p, `bytes_of(pack)` an estimate of its item's size."""

        def ready():
            self.beat("waiting for room")
            sizes, consumer = self._look()
            if consumer.get("finished"):
                return []
            end, free = consumer.get("end"), self.share - sum(sizes.values())
            position = consumer.get("next", 0)
            position += (self.shard_index - position) % self.num_shards  # the first one of this job's
            chosen, samples = [], 0
            while end is None or position < end:
                if position not in sizes:
                    pack = pack_of(position)
                    need = bytes_of(pack)
                    if not chosen and need > free:
                        free += self._evict_above(position, sizes, need - free)
                    if need > self.share:
                        raise StageError(f"stream position {position}: one pack takes {need / 1e9:.3f} GB, more than "
                                         f"this job's share of the window ({self.share / 1e9:.3f} GB = "
                                         f"capture.stream.window_gb / {self.num_shards} jobs): raise window_gb")
                    per_step = -(-consumer.get("packs_per_step", 1) // self.num_shards)
                    if need * per_step > self.share:  # else 04 would wait for a pack this job has no room for
                        raise StageError(f"a step of 04 takes {per_step} packs of this job at once, up to "
                                         f"{need * per_step / 1e9:.3f} GB, more than its share of the window: "
                                         "raise capture.stream.window_gb")
                    if need > free or (chosen and samples + len(pack) > max_samples):
                        break
                    chosen.append(position)
                    free, samples = free - need, samples + len(pack)
                position += self.num_shards
            return chosen or None

        return self.waiter.wait(ready, lambda: "window share full; waiting for 04_train to consume",
                                self._consumer_progress,
                                "04_train is not consuming: start it, or rerun it with --resume; rerun this job after")

    def _evict_above(self, position: int, sizes: dict[int, int], wanted: int) -> int:
        """Delete this job's items past `position`, the last first, until `wanted` bytes are free; returns the
        bytes freed. 04 reads in order, so the first missing position goes first: after 04 rewinds to its
        checkpoint, the items it had deleted since are missing below items still held (captured again later)."""
        freed = 0
        for later in sorted((p for p in sizes if p > position), reverse=True):
            if freed >= wanted:
                break
            self.transport.delete(later)
            freed += sizes.pop(later)
        return freed

    def put(self, position: int, data: bytes, tokens: int) -> None:
        """Make the item visible once this job's items, it included, fit the share; dropped when 04 no longer
        needs it (finished, or moved past it)."""

        def ready():
            sizes, consumer = self._look()
            if consumer.get("finished") or position < consumer.get("next", 0):
                return False
            held = sum(sizes.values())
            if held + len(data) > self.share:
                held -= self._evict_above(position, sizes, held + len(data) - self.share)
            if held + len(data) > self.share:
                self.beat("waiting for room")
                return None
            self.transport.put(position, data)
            self.counts["packs"] += 1
            self.counts["tokens"] += tokens
            self.counts["bytes"] += len(data)
            self.counts["max_held_bytes"] = max(self.counts["max_held_bytes"], held + len(data))
            self.beat("capturing")
            return True

        self.waiter.wait(ready, lambda: f"window share full with position {position} captured; waiting for "
                         "04_train to consume", self._consumer_progress,
                         "04_train is not consuming: start it, or rerun it with --resume; rerun this job after")

    def finish(self) -> bool:
        """Delete what is left of this job's items; True when every job of the stream has finished."""
        for position in self.transport.sizes():
            if self._mine(position):
                self.transport.delete(position)
        self.beat("finished", force=True)
        states = [(self.transport.read_record(producer_record(i, self.num_shards)) or {}).get("state")
                  for i in range(self.num_shards)]
        return all(state == "finished" for state in states)

    def totals(self) -> dict:
        """Counters summed over every job's record."""
        records = [self.transport.read_record(producer_record(i, self.num_shards)) or {}
                   for i in range(self.num_shards)]
        return {key: sum(r.get(key, 0) for r in records) for key in ("packs", "tokens", "bytes", "waited_s")}


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
