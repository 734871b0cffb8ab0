"""Stage 02's stream: the directory transport (`capture.stream.transport: directory`)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.config_sections import StreamConfig
from eagle3_pipeline.stage_io import atomic_path, read_json, write_json_atomic


class DirectoryTransport:
    """Items as files in one folder: local NVMe, /dev/shm, or a shared filesystem between two machines."""

    ITEM = re.compile(r"^\.?pack_(\d{10})\.safetensors(\.tmp-\d+)?$")
    shares_folder = True

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    @classmethod
    def open(cls, config: RunConfig, identity: str | None, item_bytes: int, lend_bytes: int) -> DirectoryTransport:
        return cls(stream_dir(config))

    @staticmethod
    def lend_bytes(settings: StreamConfig, share_bytes: int, published_bytes: int) -> int:
        return 0  # a folder, not a store to lend memory to

    @staticmethod
    def window_in_stage_folder(settings: StreamConfig) -> bool:
        return settings.dir is None  # the default folder is 02_hidden_states/stream

    def _item(self, position: int) -> Path:
        return self.folder / f"pack_{position:010d}.safetensors"

    def put(self, position: int, data: bytes) -> None:
        with atomic_path(self._item(position)) as tmp:
            tmp.write_bytes(data)

    def get(self, position: int) -> bytes | None:
        try:
            return self._item(position).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, position: int) -> None:
        self._item(position).unlink(missing_ok=True)

    def sizes(self) -> dict[int, int]:
        held: dict[int, int] = {}
        for entry in os.scandir(self.folder):
            match = self.ITEM.match(entry.name)
            if match:
                try:
                    held[int(match[1])] = held.get(int(match[1]), 0) + entry.stat().st_size
                except FileNotFoundError:  # deleted between listing and stat
                    pass
        return held

    def discard_partial(self, shard_index: int, num_shards: int) -> None:
        """Remove the half-written items a killed capture job left (only its own positions)."""
        for entry in os.scandir(self.folder):
            match = self.ITEM.match(entry.name)
            if match and match[2] and int(match[1]) % num_shards == shard_index:
                Path(entry.path).unlink(missing_ok=True)

    def write_record(self, name: str, record: dict) -> None:
        write_json_atomic(self.folder / f"{name}.json", record)

    def read_record(self, name: str) -> dict | None:
        return read_json(self.folder / f"{name}.json")

    def record_names(self) -> list[str]:
        return sorted(path.stem for path in self.folder.glob("*.json"))

    def describe(self) -> str:
        return str(self.folder)

    def end_stream(self) -> None:
        """The records stay in the folder: they tell what the stream did."""

    # Every side sees the folder, so 02's own folder needs no publishing.
    def clear_other_streams(self) -> None:
        """A stream's items and records carry its identity (stream.py): nothing else to clear."""

    def publish(self, folder: Path, names: list[str]) -> int:
        return 0

    def published(self) -> dict | None:
        return {}

    def fetch(self, folder: Path, listing: dict) -> None:
        """Nothing to fetch: 02's folder is this folder's parent on every side."""

    def close(self) -> None:
        """Nothing held open."""


def stream_dir(config: RunConfig) -> Path:
    return Path(config.capture.stream.dir or Path(config.run_dir) / "02_hidden_states" / "stream")
