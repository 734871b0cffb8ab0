"""Stage 02's side of the stream (stream.py): what a capture job captures next, and putting it within the job's
share of the window (`window_gb / num_shards`), its `producer-i-of-N` record beating all the while. A job may
capture up to its share of `ahead_gb` more than the window has room for: those states wait in host memory, and
their put waits for room, so the next engine call need not wait for 04 to free room first.

Two threads of 02 use a Producer at once: the one driving the engine asks for the next positions while a
writer thread puts the batch before (capture/stage.py). A lock makes each look at the window whole.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from eagle3_pipeline.capture.stream import CONSUMER, Transport, Waiter
from eagle3_pipeline.config_sections import StreamConfig
from eagle3_pipeline.stage_io import StageError


def producer_record(shard_index: int, num_shards: int) -> str:
    return f"producer-{shard_index}-of-{num_shards}"


def share_bytes(settings: StreamConfig, num_shards: int) -> int:
    """The part of the window one of `num_shards` capture jobs may fill."""
    return int(settings.window_gb * 1e9) // num_shards


class Producer:
    """One capture job's side: which positions to capture next, and putting them within its share.
    `identity()` is the stream's identity once 02 has opened it, else None."""

    def __init__(self, transport: Transport, settings: StreamConfig, shard_index: int, num_shards: int, identity):
        self.transport, self.shard_index, self.num_shards = transport, shard_index, num_shards
        self.identity = identity
        self.share = share_bytes(settings, num_shards)
        self.ahead = int(settings.ahead_gb * 1e9) // num_shards  # captured beyond the share, waiting to be put
        self.name = producer_record(shard_index, num_shards)
        self.waiter = Waiter(settings, f"02_hidden_states job {shard_index}/{num_shards}")
        # batches: the engine's capture calls, each of one or more packs (their per-call cost is paid per batch);
        # encode_s, put_s: the writer's seconds encoding the items and putting them (waits for room included)
        self.counts = {"packs": 0, "batches": 0, "tokens": 0, "bytes": 0, "max_held_bytes": 0,
                       "encode_s": 0.0, "put_s": 0.0}
        # positions chosen but not yet put (a batch still being captured), with their estimated bytes: not chosen
        # again, and counted against the share
        self.reserved: dict[int, int] = {}
        self._beat_at = 0.0
        self._lock = threading.Lock()  # one look at the window at a time (the engine's thread and the writer)
        self._cancelled = threading.Event()
        transport.discard_partial(shard_index, num_shards)

    def _mine(self, position: int) -> bool:
        return position % self.num_shards == self.shard_index

    def _look(self) -> tuple[dict[int, int], dict]:
        """(own items held, consumer record), listed in that order (see stream.py's docstring); own items
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

    def next_positions(self, pack_of, bytes_of, max_samples: int, wait: bool = True) -> list[int] | None:
        """The next positions this job captures, in order, as many as fit its free share and its room ahead (and
        `max_samples` samples); waits while none does, or returns None then when not `wait`; [] once 04 has finished.
        `pack_of(p)` gives the sample indices of position p, `bytes_of(pack)` an estimate of its item's size.
        The positions are reserved until `put`."""

        def ready():
            with self._lock:
                return choose()

        def choose():
            self.beat("waiting for room")
            sizes, consumer = self._look()
            if consumer.get("finished"):
                return []
            end = consumer.get("end")
            free = self.share + self.ahead - sum(sizes.values()) - sum(self.reserved.values())
            position = consumer.get("next", 0)
            position += (self.shard_index - position) % self.num_shards  # the first one of this job's
            chosen, samples = [], 0
            while end is None or position < end:
                if position not in sizes and position not in self.reserved:
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
                    self.reserved[position] = need
                position += self.num_shards
            return chosen or None

        if not wait:
            return ready()
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
            if self._cancelled.is_set():
                raise StageError(f"stream position {position}: not put, the capture stopped")
            with self._lock:
                return place()

        def place():
            sizes, consumer = self._look()
            if consumer.get("finished") or position < consumer.get("next", 0):
                self.reserved.pop(position, None)
                return False
            held = sum(sizes.values())
            if held + len(data) > self.share:
                held -= self._evict_above(position, sizes, held + len(data) - self.share)
            if held + len(data) > self.share:
                self.beat("waiting for room")
                return None
            self.transport.put(position, data)
            self.reserved.pop(position, None)  # held from now on: counted in the window's sizes
            self.counts["packs"] += 1
            self.counts["tokens"] += tokens
            self.counts["bytes"] += len(data)
            self.counts["max_held_bytes"] = max(self.counts["max_held_bytes"], held + len(data))
            self.beat("capturing")
            return True

        self.waiter.wait(ready, lambda: f"window share full with position {position} captured; waiting for "
                         "04_train to consume", self._consumer_progress,
                         "04_train is not consuming: start it, or rerun it with --resume; rerun this job after")

    def batch_captured(self) -> None:
        with self._lock:
            self.counts["batches"] += 1

    def cancel(self) -> None:
        """Make a put that waits for room stop (the capture failed elsewhere), instead of waiting out the timeout."""
        self._cancelled.set()

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
        return {key: sum(r.get(key, 0) for r in records)
                for key in ("packs", "batches", "tokens", "bytes", "waited_s", "encode_s", "put_s")}
