"""Packing and the data stream: every sample once per epoch, rows fit, the same global batches at any scale."""

from __future__ import annotations

import numpy as np
import torch

from eagle3_pipeline.capture.store import SampleStates
from eagle3_pipeline.pack_plan import PackStream, plan_packs
from eagle3_pipeline.train.data import PackedRows, RankPacks, rank_share


def test_packs_hold_every_sample_once_within_capacity():
    rows = np.random.default_rng(0).integers(0, 300, 500)
    packs = plan_packs(rows, 512, seed=[0, 0])
    flat = sorted(i for pack in packs for i in pack)
    assert flat == sorted(np.flatnonzero(rows > 0).tolist())  # samples without rows are skipped
    assert all(rows[list(pack)].sum() <= 512 for pack in packs)
    assert rows.sum() / (len(packs) * 512) > 0.9  # first fit keeps padding low
    assert plan_packs(rows, 512, seed=[0, 0]) == packs != plan_packs(rows, 512, seed=[0, 1])


def test_global_batches_are_the_same_for_any_split_into_processes_and_micro_batches():
    stream = PackStream(np.random.default_rng(1).integers(1, 100, 40), 128, seed=3)

    def consumed(world_size: int, per_rank: int, start: int = 0) -> list[set]:
        ranks = [[pack for _, pack in RankPacks(stream, start, 6, r, world_size, per_rank)] for r in range(world_size)]
        return [{pack for rank in ranks for pack in rank[s * per_rank:(s + 1) * per_rank]} for s in range(6 - start)]

    one_process = consumed(1, 4)
    assert consumed(2, 2) == one_process == consumed(4, 1)
    assert consumed(2, 2, start=3) == one_process[3:]  # resuming at step 3 continues the same stream
    epoch0 = len(stream.epoch(0))
    assert 6 * 4 > epoch0 and stream.locate(epoch0) == (1, 0)  # the stream runs on into the next epoch


def test_every_rank_gets_as_many_eval_packs():
    packs = [(i,) for i in range(5)]
    shares = [rank_share(packs, r, 2) for r in range(2)]
    assert shares == [[(None, (0,)), (None, (2,)), (None, (4,))], [(None, (1,)), (None, (3,)), (None, ())]]


def test_packed_row_is_the_shifted_samples_then_padding(tmp_path):
    from tests.train.fabricate import write_shard_folder

    samples = [{"id": "a", "input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]},
               {"id": "b", "input_ids": [9, 10, 11], "loss_mask": [0, 0, 1]}]
    states = [SampleStates(s["id"], torch.arange(len(s["input_ids"]) * 2 * 4, dtype=torch.float32).view(-1, 2, 4),
                           torch.arange(len(s["input_ids"]) * 4, dtype=torch.float32).view(-1, 4) + 100)
              for s in samples]
    folder = write_shard_folder(tmp_path, states)
    row = PackedRows(samples, folder, capacity=8, aux_width=8, hidden_size=4)[(None, (1, 0))]
    assert row["input_ids"].tolist() == [10, 11, 6, 7, 8, 0, 0, 0]
    assert row["document_ids"].tolist() == [0, 0, 1, 1, 1, -1, -1, -1]
    assert row["position_ids"].tolist() == [0, 1, 0, 1, 2, 0, 0, 0]
    assert row["loss_mask"].tolist() == [False, True, True, True, True, False, False, False]
    assert torch.equal(row["aux"][2], states[0].aux[0].flatten().bfloat16())  # row t: aux states of token t
    assert torch.equal(row["final"][2], states[0].final[1].bfloat16())  # final state of token t + 1
    assert not row["aux"][5:].any()
