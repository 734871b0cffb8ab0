"""04's pack plan: which samples each training row packs, in which order, epoch after epoch.

A pack concatenates whole samples (first fit, in a seeded random order). The plan depends only on 01's sample
lengths, `train.packed_length` and `train.seed`, so 02 knows it before any state exists (stream mode
captures in this order) and 04 trains in it (train/data.py turns packs into rows). `run_pack_stream` builds
a run's plan; 02 records `plan_settings` with its stream and 04 checks them.
"""

from __future__ import annotations

import numpy as np

from eagle3_pipeline.config import RunConfig

FIRST_FIT_WINDOW = 32  # a sample joins the first of the last 32 packs with room: bounded cost, little padding


def training_rows(seq_len):
    """The training rows of a sample of `seq_len` tokens (an int or an array of them): row t pairs token t's
    states with token t+1 (train/data.py), so the last token starts no row."""
    return seq_len - 1


def plan_settings(config: RunConfig) -> dict:
    """What a run's pack plan depends on besides 01's sample lengths."""
    return {"packed_length": config.train.packed_length, "seed": config.train.seed}


def run_pack_stream(config: RunConfig, seq_lens) -> PackStream:
    """The run's pack stream over the train split's samples of `seq_lens` tokens (01_data's `seq_len`)."""
    return PackStream(training_rows(np.asarray(seq_lens, dtype=np.int64)), config.train.packed_length,
                      config.train.seed)


def plan_packs(rows_per_sample: np.ndarray, capacity: int, seed: list[int]) -> list[tuple[int, ...]]:
    """Sample indices of each pack: first fit over a seeded random order, packs in a seeded random order."""
    rng = np.random.default_rng(seed)
    packs: list[list[int]] = []
    room: list[int] = []
    for index in rng.permutation(len(rows_per_sample)):
        rows = int(rows_per_sample[index])
        if rows == 0:
            continue
        first = max(0, len(packs) - FIRST_FIT_WINDOW)
        target = next((p for p in range(first, len(packs)) if room[p] >= rows), None)
        if target is None:
            packs.append([])
            room.append(capacity)
            target = len(packs) - 1
        packs[target].append(int(index))
        room[target] -= rows
    order = rng.permutation(len(packs))
    return [tuple(packs[p]) for p in order]


class PackStream:
    """The endless sequence of packs a run trains on: epoch e is packed with seed (seed, e)."""

    def __init__(self, rows_per_sample: np.ndarray, capacity: int, seed: int):
        self.rows_per_sample, self.capacity, self.seed = rows_per_sample, capacity, seed
        self._epoch_sizes: list[int] = []  # packs per epoch, for the epochs planned so far
        self._plans: dict[int, list[tuple[int, ...]]] = {}

    def epoch(self, epoch: int) -> list[tuple[int, ...]]:
        if epoch not in self._plans:
            if len(self._plans) == 2:  # the stream is read in order: keep the current epoch and the next
                del self._plans[min(self._plans)]
            self._plans[epoch] = plan_packs(self.rows_per_sample, self.capacity, seed=[self.seed, epoch])
        return self._plans[epoch]

    def locate(self, position: int) -> tuple[int, int]:
        """(epoch, index in that epoch) of a stream position."""
        epoch = 0
        while True:
            if epoch == len(self._epoch_sizes):
                self._epoch_sizes.append(len(self.epoch(epoch)))
            if position < self._epoch_sizes[epoch]:
                return epoch, position
            position -= self._epoch_sizes[epoch]
            epoch += 1

    def pack(self, position: int) -> tuple[int, ...]:
        epoch, index = self.locate(position)
        return self.epoch(epoch)[index]
