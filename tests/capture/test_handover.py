"""The worker extension's mapped hand-over against the pageable one, on CPU (no vLLM): eagle3_pipeline.capture's
recording path driven as vLLM's model runner drives it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle3_pipeline.capture import handover
from eagle3_pipeline.capture.handover import ORPHAN_PREFIX, MappedArena, load_captured
from eagle3_pipeline.capture.worker import HiddenStateCapture

HIDDEN, NUM_AUX = 16, 3
PROMPTS = {"a": list(range(100, 110)), "b": list(range(200, 204)), "c": list(range(300, 308))}


def step(rows: dict[str, tuple[int, int]], seed: int) -> dict:
    """A forward step computing tokens start:end of each named request, with states of its own."""
    ids = [t for r, (a, b) in rows.items() for t in PROMPTS[r][a:b]]
    bounds = [0]
    for a, b in rows.values():
        bounds.append(bounds[-1] + b - a)
    states = torch.randn(NUM_AUX + 1, len(ids) + 3, HIDDEN, generator=torch.Generator().manual_seed(seed),
                         dtype=torch.float32).to(torch.bfloat16)  # 3 rows of padding past the last request
    return {"req_ids": list(rows), "starts": torch.tensor(bounds, dtype=torch.int32),
            "token_ids": torch.tensor(ids + [0, 0, 0], dtype=torch.int32),
            "positions": torch.cat([torch.arange(a, b) for a, b in rows.values()] + [torch.zeros(3, dtype=torch.long)]),
            "aux": list(states[:NUM_AUX]), "final": states[-1]}


# "a" is chunked over two steps; "b" is preempted and recomputed from its start in the last step.
STEPS = [step({"a": (0, 6), "b": (0, 3)}, 0), step({"a": (6, 10), "c": (0, 8)}, 1), step({"b": (0, 4)}, 2)]
OUTPUTS = [SimpleNamespace(request_id=r, prompt_token_ids=ids) for r, ids in PROMPTS.items()]


def record(worker: HiddenStateCapture, step: dict) -> None:
    # the step's batch as `StepBatch.take` reads it from either model runner
    batch = step["req_ids"], step["starts"][: len(step["req_ids"]) + 1].tolist(), step["token_ids"]
    worker._record_step(batch, step["aux"], step["final"], step["positions"])


def captured(handover: str, folder: Path, rounds: int = 1) -> list[list[dict[str, torch.Tensor]]]:
    folder.mkdir()
    worker = HiddenStateCapture.without_engine(NUM_AUX, handover, str(folder))
    results, slabs = [], {}  # the slabs are mapped once, as the capturer keeps them
    for _ in range(rounds):  # the mapped slabs are reused from the second round on
        for s in STEPS:
            record(worker, s)
        results.append(load_captured(OUTPUTS, worker.pop_captured(str(folder / "spool")), slabs))
        spool = folder / "spool"
        assert not (spool.exists() and list(spool.iterdir()))  # load_captured removed what pop_captured wrote
    return results


# The reader copies steps out in blocks (handover.StepCopy): its default (every step here in one block), and blocks of
# 4 rows (136 bytes a row here), where "a" and "c" span block boundaries and "a"'s second chunk fills a block.
BLOCK_SIZES = [handover.BLOCK_BYTES, 4 * 136]


@pytest.mark.parametrize("block_bytes", BLOCK_SIZES)
def test_mapped_hand_over_equals_pageable_bit_for_bit(tmp_path, monkeypatch, block_bytes):
    monkeypatch.setattr(handover, "BLOCK_BYTES", block_bytes)
    (today,) = captured("pageable", tmp_path / "pageable")
    for mapped in captured("mapped", tmp_path / "mapped", rounds=2):
        for ours, reference in zip(mapped, today):
            assert ours.keys() == reference.keys()
            for name in reference:
                assert ours[name].dtype == reference[name].dtype and torch.equal(ours[name], reference[name])
    assert [len(c["token_ids"]) for c in today] == [10, 4, 8]
    assert torch.equal(today[1]["final_hidden_state"], STEPS[2]["final"][:4])  # "b" as recomputed


@pytest.mark.parametrize("block_bytes", BLOCK_SIZES)
def test_states_read_stay_intact_once_their_slabs_are_reused(tmp_path, monkeypatch, block_bytes):
    """What load_captured returns is the reader's own memory: two rounds later the worker writes the same slabs."""
    monkeypatch.setattr(handover, "BLOCK_BYTES", block_bytes)
    (reference,) = captured("pageable", tmp_path / "pageable")
    worker = HiddenStateCapture.without_engine(NUM_AUX, "mapped", str(tmp_path))
    read, slabs = [], {}
    for shift in range(3):  # round 2 writes where round 0 lay
        for s in STEPS:
            record(worker, {**s, "aux": [a + shift for a in s["aux"]], "final": s["final"] + shift})
        read.append(load_captured(OUTPUTS, worker.pop_captured(str(tmp_path / "spool")), slabs))
    for shift, states in enumerate(read):
        for ours, expected in zip(states, reference):
            assert torch.equal(ours["aux_hidden_states"], expected["aux_hidden_states"] + shift)
            assert torch.equal(ours["final_hidden_state"], expected["final_hidden_state"] + shift)
            assert torch.equal(ours["token_ids"], expected["token_ids"])


def test_the_mapped_hand_over_writes_no_file_per_request(tmp_path):
    """Where each request's chunks lie travels in pop_captured's result (a few hundred bytes a request): no file is
    written in the spool, and the result is what vLLM's RPC can carry (plain JSON types)."""
    worker = HiddenStateCapture.without_engine(NUM_AUX, "mapped", str(tmp_path))
    for s in STEPS:
        record(worker, s)
    located = worker.pop_captured(str(tmp_path / "spool"))
    assert not (tmp_path / "spool").exists()
    assert json.loads(json.dumps(located)) == located and sorted(located) == ["a", "b", "c"]
    assert [len(chunks) for chunks in located.values()] == [2, 2, 1]  # "a" chunked, "b" recomputed


def test_outputs_are_matched_to_internal_request_ids():
    """vLLM's worker may see a request's id with a random suffix; an id matching none or two captures fails."""
    output = SimpleNamespace(request_id="1", prompt_token_ids=[1, 2])
    with pytest.raises(KeyError, match="request 1: 0 captures match"):
        load_captured([output], {"10-x": "10-x.safetensors", "11": "11.safetensors"})
    with pytest.raises(KeyError, match="request 1: 2 captures match"):
        load_captured([output], {"1-x": "1-x.safetensors", "1-y": "1-y.safetensors"})


def test_mapped_hand_over_checks_tokens_against_the_prompt(tmp_path):
    worker = HiddenStateCapture.without_engine(NUM_AUX, "mapped", str(tmp_path))
    for s in STEPS:
        record(worker, s)
    paths = worker.pop_captured(str(tmp_path / "spool"))
    wrong = [SimpleNamespace(request_id="a", prompt_token_ids=PROMPTS["c"])]
    with pytest.raises(ValueError, match="not its prompt"):
        load_captured(wrong, paths)


def test_handover_is_validated():
    with pytest.raises(ValueError, match="handover 'pinned'"):
        HiddenStateCapture().set_capture_layers([1], handover="pinned")


def test_a_killed_workers_slabs_are_removed(tmp_path):
    dead, alive = tmp_path / f"{ORPHAN_PREFIX}999999999-x", tmp_path / f"{ORPHAN_PREFIX}{os.getpid()}-y"
    dead.mkdir(), alive.mkdir()
    arena = MappedArena(pin=False, directory=str(tmp_path))
    assert not dead.exists() and alive.exists() and Path(arena.directory).exists()


def test_both_banks_are_mapped_before_the_first_step(tmp_path):
    """Page-locking a slab is slow on a GPU: both banks' first slabs are made together, not the second one in the
    middle of a capture."""
    arena = MappedArena(pin=False, directory=str(tmp_path))
    assert [len(bank) for bank in arena.banks] == [1, 1] and len(arena.mapped) == 2
    arena.put({"token_ids": torch.arange(4)})
    arena.next_round()
    arena.put({"token_ids": torch.arange(4)})
    assert len(arena.mapped) == 2


def test_a_round_stays_readable_while_the_next_is_recorded(tmp_path):
    """capture_batches reads one round's states while the engine records the next: the mapped slabs take turns in
    two banks, so the round before is intact until the round after the next one."""
    (reference,) = captured("pageable", tmp_path / "pageable")
    (tmp_path / "mapped").mkdir()
    worker = HiddenStateCapture.without_engine(NUM_AUX, "mapped", str(tmp_path / "mapped"))
    rounds, slabs = [], {}  # mapped once, read in every round after: the mapping sees each round's new states
    for shift in range(3):  # each round's states differ: every step's states plus the round number
        for s in STEPS:
            record(worker, {**s, "aux": [a + shift for a in s["aux"]], "final": s["final"] + shift})
        rounds.append(worker.pop_captured(str(tmp_path / f"spool{shift}")))
        if shift >= 1:  # the round before, read only now that this one is recorded
            before = load_captured(OUTPUTS, rounds[shift - 1], slabs)
            for ours, expected in zip(before, reference):
                assert torch.equal(ours["final_hidden_state"], expected["final_hidden_state"] + (shift - 1))
                assert torch.equal(ours["aux_hidden_states"], expected["aux_hidden_states"] + (shift - 1))
    assert len({path for bank in worker._capture_arena.banks for path, _ in bank}) == 2  # one slab a bank, reused
