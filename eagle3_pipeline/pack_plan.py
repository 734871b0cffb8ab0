"""04's pack plan: which samples each training row packs, in which order, epoch after epoch.

A pack concatenates whole samples (first fit, in a seeded random order). The plan depends only on 01's sample
lengths, `train.packed_length` and `train.seed`, so 02 knows it before any state exists (stream mode
captures in this order) and 04 trains in it (train/data.py turns packs into rows).
"""

from __future__ import annotations

import numpy as np

FIRST_FIT_WINDOW = 32  # a sample joins the first of the last 32 packs with room: bounded cost, little padding


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
