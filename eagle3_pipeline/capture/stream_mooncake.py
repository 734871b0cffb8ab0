"""The Mooncake store as the stream's transport (`capture.stream.transport: mooncake`): capture and trainer nodes
that share no filesystem exchange the states through the memory of a Mooncake store (docs/mooncake.md).

Mooncake's own Python client (`mooncake.store.MooncakeDistributedStore`) is used directly rather than through
hs-connectors' `MooncakeHiddenStatesStore`: that class stores one vLLM request per object under a transfer
manifest its vLLM connector hands out, and has neither small mutable objects (our consumer and producer records
need `upsert`) nor a way to list what a stream holds (the window accounting and the resume rules of stream.py
need one). Our item is one pack of several samples in its own checked format (stream.py `encode_item`).

Keys, all under `capture.stream.mooncake.key_prefix` (one stream per prefix):

    <prefix>/files/...              02's folder as the stream opened it (stream.json, the eval split's shards,
                                    index.json): the trainer and the other capture jobs fetch it from here
    <prefix>/<stream id>/pack_<p>   the item of stream position p (the stream id: the start of stream.json's hash)
    <prefix>/<stream id>/rec/<name> the consumer and producer records

A put is visible only once complete (Mooncake's put is atomic), so there are no partial items to discard. The
capture jobs lend the store its memory (`segment_gb` each); the trainer lends none. Every failing call raises a
StageError naming the master: a master that goes away ends both sides with exit 1 within seconds, never a hang.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.config_sections import MooncakeConfig, StreamConfig
from eagle3_pipeline.stage_io import StageError, atomic_path

NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND status
NOT_READY = -703  # REPLICA_IS_NOT_READY: the object is being written
NOT_READY_RETRIES, NOT_READY_SLEEP_S = 200, 0.005
FILE_CHUNK_BYTES = 64 << 20  # published files travel in objects of at most this size
MIN_SEGMENT_BYTES = 16 << 20  # Mooncake refuses to mount a smaller segment (status -600)
EVICTION_HEADROOM = 0.85  # Mooncake's master evicts objects above 90% of the store's memory: stay under it
ADMIN_TIMEOUT_S = 10.0
STATUS_HINTS = {
    -200: "the store has no room: no capture job is connected (they lend the store its memory), or "  # NO_AVAILABLE_HANDLE
          "capture.stream.mooncake.segment_gb is too small",
    -600: "an object is larger than this client's transfer buffer",  # BUFFER_OVERFLOW
}


class MooncakeTransport:
    """stream.Transport over a Mooncake store. `stream_id` is None for a transport that only reads or writes
    the published files (before the stream's identity is known). `buffer_bytes` must hold the largest object
    moved (an item or a file chunk); `lend_bytes` is the memory this process lends the store (capture jobs;
    at least MIN_SEGMENT_BYTES when not 0)."""

    shares_folder = False  # 02's folder travels through the store (publish, fetch)

    @classmethod
    def open(cls, config: RunConfig, identity: str | None, item_bytes: int, lend_bytes: int) -> MooncakeTransport:
        return cls(config.capture.stream.mooncake, identity, item_bytes, lend_bytes)

    @staticmethod
    def lend_bytes(settings: StreamConfig, share_bytes: int, published_bytes: int) -> int:
        """The memory a capture job lends the store: `segment_gb`, or its share of the window kept under the
        eviction threshold, plus what it publishes."""
        if settings.mooncake.segment_gb is not None:
            return int(settings.mooncake.segment_gb * 1e9)
        return int(share_bytes / EVICTION_HEADROOM) + published_bytes + FILE_CHUNK_BYTES

    @staticmethod
    def window_in_stage_folder(settings: StreamConfig) -> bool:
        return False

    def __init__(self, settings: MooncakeConfig, stream_id: str | None, buffer_bytes: int, lend_bytes: int = 0):
        self.settings, self.stream_id = settings, stream_id
        self.buffer_bytes = max(buffer_bytes, FILE_CHUNK_BYTES) + (1 << 20)
        # Only capture jobs lend memory: what a process lends leaves the store with it, and the trainer's last
        # record (`finished`) must outlive the trainer.
        self.lend_bytes = max(lend_bytes, MIN_SEGMENT_BYTES) if lend_bytes else 0
        self.prefix = f"{settings.key_prefix}/"
        self.stream_prefix = f"{self.prefix}{stream_id[:16]}/" if stream_id else None
        self._client, self._pid = None, None

    def describe(self) -> str:
        return f"the Mooncake store of master {self.settings.master} (keys {self.prefix}*)"

    # ------------------------------------------------------------------------------------------ client
    def _store(self):
        """This process's client, connected on first use (data loader workers each get their own)."""
        if self._client is None or self._pid != os.getpid():
            os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's C++ client logs every call at INFO
            try:
                from mooncake.store import MooncakeDistributedStore
            except ImportError as err:
                raise StageError(f"capture.stream.transport mooncake needs the Mooncake client ({err}): run "
                                 "`make setup` (mooncake-transfer-engine-non-cuda; on GPU nodes see "
                                 "docs/mooncake.md for the build to install)") from None
            client = MooncakeDistributedStore()
            hostname = self.settings.local_hostname or socket.gethostname()
            status = client.setup(hostname, "P2PHANDSHAKE", self.lend_bytes, self.buffer_bytes, self.settings.protocol,
                                  self.settings.device_name, self.settings.master)
            if status != 0:
                raise self._error("connecting", status)
            self._client, self._pid = client, os.getpid()
        return self._client

    def __getstate__(self) -> dict:  # a pickled copy (a data loader worker) connects on its own
        return {**self.__dict__, "_client": None, "_pid": None}

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None and self._pid == os.getpid():
            client.close()

    def _error(self, operation: str, status) -> StageError:
        """The error that ends this side. The client is closed first: once its background thread has begun
        reconnecting to a master that is gone, closing (or exiting) waits for that thread for many seconds."""
        self.close()
        hint = STATUS_HINTS.get(status, "is mooncake_master running and reachable (capture.stream.mooncake.master)? "
                                "Restart it, then rerun 02_generate_hidden_states.py and 04_train.py --resume")
        return StageError(f"Mooncake master {self.settings.master}: {operation} failed (status {status}); {hint}")

    def _checked(self, operation: str, status: int, allowed: tuple[int, ...] = ()) -> int:
        if status < 0 and status not in allowed:
            raise self._error(operation, status)
        return status

    def _admin(self, path: str) -> str:
        host = self.settings.master.rpartition(":")[0] or self.settings.master
        url = f"http://{host}:{self.settings.admin_port}/{path}"
        try:
            with urllib.request.urlopen(url, timeout=ADMIN_TIMEOUT_S) as response:
                return response.read().decode()
        except (urllib.error.URLError, OSError) as err:
            self.close()  # as in _error
            raise StageError(f"Mooncake master {self.settings.master}: its admin service {url} does not answer "
                             f"({err}); is mooncake_master running with --metrics_port "
                             f"{self.settings.admin_port} (capture.stream.mooncake.admin_port)?") from None

    def keys(self, prefix: str) -> list[str]:
        """The store's keys that start with `prefix`."""
        return [key for key in self._admin("get_all_keys").splitlines() if key.startswith(prefix)]

    def allocated_bytes(self) -> int:
        """The memory the store's objects take now, as the master counts it (its `master_allocated_bytes`)."""
        for line in self._admin("metrics").splitlines():
            if line.startswith("master_allocated_bytes "):
                return int(float(line.split()[1]))
        raise StageError(f"Mooncake master {self.settings.master}: its metrics carry no master_allocated_bytes")

    def _put(self, key: str, data: bytes) -> None:
        self._checked(f"storing {key} ({len(data):,} bytes)", self._store().upsert(key, data))

    def _get(self, key: str, wait_ready: bool = False) -> bytes | None:
        """The object, or None when absent. One being written is absent too, unless `wait_ready` (a record being
        replaced: its old and new values are both valid, and the write takes milliseconds)."""
        for _ in range(NOT_READY_RETRIES if wait_ready else 1):
            size = self._checked(f"reading {key}", self._store().get_size(key), allowed=(NOT_FOUND, NOT_READY))
            if size != NOT_READY:
                break
            time.sleep(NOT_READY_SLEEP_S)
        if size in (NOT_FOUND, NOT_READY):
            return None
        data = self._store().get(key)
        return data if len(data) == size else None  # deleted between the two calls: as if never there

    def _remove(self, key: str) -> None:
        self._checked(f"deleting {key}", self._store().remove(key, force=True), allowed=(NOT_FOUND,))

    # --------------------------------------------------------------------------- stream.Transport
    def _item(self, position: int) -> str:
        return f"{self.stream_prefix}pack_{position:010d}"

    def put(self, position: int, data: bytes) -> None:
        self._put(self._item(position), data)

    def get(self, position: int) -> bytes | None:
        return self._get(self._item(position))

    def delete(self, position: int) -> None:
        self._remove(self._item(position))

    def sizes(self) -> dict[int, int]:
        held = {}
        for key in self.keys(f"{self.stream_prefix}pack_"):
            size = self._checked(f"reading {key}", self._store().get_size(key), allowed=(NOT_FOUND, NOT_READY))
            if size >= 0:
                held[int(key.rpartition("_")[2])] = size
        return held

    def discard_partial(self, shard_index: int, num_shards: int) -> None:
        """Nothing to do: a Mooncake put is atomic."""

    def write_record(self, name: str, record: dict) -> None:
        self._put(f"{self.stream_prefix}rec/{name}", json.dumps(record).encode())

    def read_record(self, name: str) -> dict | None:
        data = self._get(f"{self.stream_prefix}rec/{name}", wait_ready=True)
        return json.loads(data) if data else None

    def record_names(self) -> list[str]:
        return sorted(key.rpartition("/")[2] for key in self.keys(f"{self.stream_prefix}rec/"))

    # ---------------------------------------------------------------------------------- published files
    def clear_other_streams(self) -> None:
        """Delete what earlier streams left under the prefix (a stream opened afresh owns it)."""
        for key in self.keys(self.prefix):
            if not key.startswith(self.stream_prefix):
                self._remove(key)

    def end_stream(self) -> None:
        """Delete everything under the prefix (every side has finished) and disconnect."""
        for key in self.keys(self.prefix):
            self._remove(key)
        self.close()

    def publish(self, folder: Path, names: list[str]) -> int:
        """Put the files `names` of `folder` in the store, in chunks, the list last; returns the bytes put."""
        listing = {}
        for name in names:
            digest, chunks = hashlib.sha256(), 0
            with open(folder / name, "rb") as source:
                while chunk := source.read(FILE_CHUNK_BYTES):
                    self._put(f"{self.prefix}files/{name}/{chunks}", chunk)
                    digest.update(chunk)
                    chunks += 1
            listing[name] = {"chunks": chunks, "bytes": (folder / name).stat().st_size, "sha256": digest.hexdigest()}
        self._put(f"{self.prefix}files/.list", json.dumps(listing).encode())
        return sum(entry["bytes"] for entry in listing.values())

    def published(self) -> dict | None:
        """The published files' list (name -> chunks, bytes, sha256), or None before 02 has published."""
        data = self._get(f"{self.prefix}files/.list", wait_ready=True)
        return json.loads(data) if data else None

    def fetch(self, folder: Path, listing: dict) -> None:
        """Write the published files into `folder`, each checked against its hash; stream.json last."""
        for name in sorted(listing, key=lambda n: n == "stream.json"):
            entry, digest = listing[name], hashlib.sha256()
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(folder / name) as tmp, open(tmp, "wb") as target:
                for chunk_index in range(entry["chunks"]):
                    chunk = self._get(f"{self.prefix}files/{name}/{chunk_index}")
                    if chunk is None:
                        raise StageError(f"{self.describe()}: published file {name} is incomplete (chunk "
                                         f"{chunk_index} missing); rerun 02_generate_hidden_states.py job 0")
                    digest.update(chunk)
                    target.write(chunk)
            if digest.hexdigest() != entry["sha256"]:
                (folder / name).unlink()
                raise StageError(f"{self.describe()}: published file {name} does not match its hash; rerun "
                                 "02_generate_hidden_states.py job 0")
