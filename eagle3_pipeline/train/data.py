"""Training rows: each sample shifted by one token, samples packed into rows of `train.packed_length`.

A sample of T tokens x[0..T-1] with captured states h[0..T-1] gives T-1 rows (see draft_model.py):

    row t:  input_ids x[t+1], aux h_aux[t], final h_final[t+1], loss_mask[t+1], position t, document d

A pack concatenates whole samples (first fit, in a seeded random order) and pads the rest of the row
(document -1, loss_mask 0). The run reads an endless stream of packs, epoch after epoch, each epoch packed
and ordered with its own seed; optimizer step s consumes stream positions [s*G, (s+1)*G) for a global batch
of G = processes x micro_batch_size x grad_accumulation packs, rank r the slice it owns. The stream depends
only on the data and the config, so a resumed run continues exactly at `step * G`, and a 2-process run sees
the same global batches as a 1-process run with twice the accumulation.
"""

from __future__ import annotations

from pathlib import Path

import torch

from eagle3_pipeline.capture.store import StatesLayout, open_reader
from eagle3_pipeline.capture.stream import Consumer, decode_item
from eagle3_pipeline.pack_plan import PackStream, training_rows
from eagle3_pipeline.stage_io import StageError


class RankPacks(torch.utils.data.Sampler):
    """The packs one rank trains on from `start_step` on, micro-batch after micro-batch, in step order."""

    def __init__(self, stream: PackStream, start_step: int, max_steps: int, rank: int, world_size: int,
                 packs_per_rank: int):
        self.stream, self.start_step, self.max_steps = stream, start_step, max_steps
        self.rank, self.world_size, self.packs_per_rank = rank, world_size, packs_per_rank

    def __len__(self) -> int:
        return (self.max_steps - self.start_step) * self.packs_per_rank

    def __iter__(self):
        global_batch = self.world_size * self.packs_per_rank
        for step in range(self.start_step, self.max_steps):
            first = step * global_batch + self.rank * self.packs_per_rank
            for position in range(first, first + self.packs_per_rank):
                yield position, self.stream.pack(position)


def rank_share(packs: list[tuple[int, ...]], rank: int, world_size: int) -> list[tuple[None, tuple[int, ...]]]:
    """Every world_size-th pack from `rank`, padded with empty packs so that all ranks run as many
    (as (position, pack) items; eval packs have no stream position)."""
    share = packs[rank::world_size]
    return [(None, pack) for pack in share + [()] * (-(-len(packs) // world_size) - len(share))]


class PackedRows(torch.utils.data.Dataset):
    """Builds one packed row from a (stream position, sample indices) item: 01 dataset + 02 hidden states."""

    def __init__(self, dataset, states_dir: Path, capacity: int, aux_width: int, hidden_size: int):
        self.dataset, self.states_dir, self.capacity = dataset, states_dir, capacity
        self.aux_width, self.hidden_size = aux_width, hidden_size
        self._reader = None  # opened in the process that reads (data loader workers included)

    def __getitem__(self, item: tuple[int | None, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        position, pack = item
        rows = _empty_rows(self.capacity, self.aux_width, self.hidden_size)
        offset = 0
        for document, (ids, aux, final, mask) in enumerate(self.samples(position, pack)):
            span = slice(offset, offset + training_rows(len(ids)))
            rows["input_ids"][span] = ids[1:]
            rows["aux"][span] = aux[:-1].flatten(1)
            rows["final"][span] = final[1:]
            rows["loss_mask"][span] = mask[1:]
            rows["position_ids"][span] = torch.arange(training_rows(len(ids)))
            rows["document_ids"][span] = document
            offset = span.stop
        return rows

    def samples(self, position: int | None, pack: tuple[int, ...]):
        """(input ids, aux, final, loss mask) of each sample of the pack, from the shards of 02."""
        if self._reader is None:
            self._reader, _ = open_reader(self.states_dir)
        for index in pack:
            sample = self.dataset[index]
            ids = torch.tensor(sample["input_ids"], dtype=torch.long)
            aux, final = self._reader.get(sample["id"])
            if aux.shape[0] != len(ids):
                raise StageError(f"sample {sample['id']}: {len(ids)} tokens in 01_data but {aux.shape[0]} captured "
                                 "states in 02_hidden_states; rerun 02 with --force")
            yield ids, aux, final, torch.tensor(sample["loss_mask"], dtype=torch.bool)


class StreamedRows(PackedRows):
    """Train packs from 02's stream (capture.mode stream), each checked against this pack plan before use;
    eval packs (no position) from 02's shards as offline."""

    def __init__(self, dataset, states_dir: Path, capacity: int, aux_width: int, hidden_size: int,
                 consumer: Consumer, layout: StatesLayout):
        super().__init__(dataset, states_dir, capacity, aux_width, hidden_size)
        self.consumer, self.layout = consumer, layout

    def samples(self, position: int | None, pack: tuple[int, ...]):
        if position is None:
            yield from super().samples(position, pack)
            return
        rows = [self.dataset[index] for index in pack]
        expected = [(row["id"], len(row["input_ids"])) for row in rows]
        states = decode_item(self.consumer.get(position), position, expected, len(self.layout.aux_layer_ids),
                             self.hidden_size, self.layout.dtype)
        for row, (aux, final) in zip(rows, states):
            yield (torch.tensor(row["input_ids"], dtype=torch.long), aux, final,
                   torch.tensor(row["loss_mask"], dtype=torch.bool))


def _empty_rows(length: int, aux_width: int, hidden: int) -> dict[str, torch.Tensor]:
    return {
        "aux": torch.zeros(length, aux_width, dtype=torch.bfloat16),
        "final": torch.zeros(length, hidden, dtype=torch.bfloat16),
        "input_ids": torch.zeros(length, dtype=torch.long),
        "position_ids": torch.zeros(length, dtype=torch.long),
        "document_ids": torch.full((length,), -1, dtype=torch.long),
        "loss_mask": torch.zeros(length, dtype=torch.bool),
    }
