"""Stage 03: the draft vocabulary (selection rule, d2t/t2d, coverage, files) and its command line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from speculators.train.vocab_mapping import build_vocab_mappings_from_distribution

from eagle3_pipeline.config import ConfigError
from eagle3_pipeline.stage_io import read_manifest
from eagle3_pipeline.stand_ins.fabricated_stages import write_data_stage
from eagle3_pipeline.vocab import select_draft_vocab
from tests.conftest import run_python
from tests.train.fabricate import random_samples, tiny_run_config, tiny_target


def test_most_frequent_tokens_sorted_by_id_ties_to_the_lower_id():
    counts = torch.tensor([0, 5, 3, 5, 0, 9, 3, 1])
    vocab = select_draft_vocab(counts, 4, [])
    assert vocab.target_ids.tolist() == [1, 2, 3, 5]  # 9, 5, 5, then 3 (id 2 beats id 6)
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [1, 1, 1, 2]
    assert vocab.t2d.tolist() == [False, True, True, True, False, True, False, False]
    assert vocab.coverage == pytest.approx(22 / 26)


def test_always_include_is_kept_whatever_its_count():
    counts = torch.tensor([0, 5, 3, 5, 0, 9, 3, 1])
    vocab = select_draft_vocab(counts, 4, [4, 7])
    assert vocab.target_ids.tolist() == [1, 4, 5, 7]  # forced 4 and 7, then 9 (id 5) and 5 (id 1 before 3)


def test_unseen_tokens_pad_by_lowest_id_like_speculators():
    counts = torch.zeros(50, dtype=torch.int64)
    counts[[7, 30, 41]] = torch.tensor([4, 2, 2])
    ours = select_draft_vocab(counts, 8, [])
    d2t, t2d = build_vocab_mappings_from_distribution({7: 4, 30: 2, 41: 2}, 8, 50)
    assert torch.equal(ours.d2t, d2t) and torch.equal(ours.t2d, t2d)
    assert ours.coverage == 1.0


def test_selection_matches_speculators_on_a_realistic_distribution():
    gen = torch.Generator().manual_seed(0)
    counts = (torch.rand(5000, generator=gen) ** 8 * 1000).long()  # long tail, many ties at small counts
    ours = select_draft_vocab(counts, 700, [])
    theirs = build_vocab_mappings_from_distribution({i: int(c) for i, c in enumerate(counts) if c}, 700, 5000)
    assert torch.equal(ours.d2t, theirs[0]) and torch.equal(ours.t2d, theirs[1])


@pytest.mark.parametrize(("size", "forced", "says"), [
    (9, [], "exceeds the target vocabulary"),
    (2, [1, 2, 3], "more than draft.draft_vocab_size"),
    (4, [8], r"ids must lie in \[0, 8\)"),
])
def test_impossible_requests_are_config_errors(size, forced, says):
    with pytest.raises(ConfigError, match=says):
        select_draft_vocab(torch.ones(8, dtype=torch.int64), size, forced)


def test_stage_writes_both_formats_and_records_coverage(tmp_path):
    config, path = tiny_run_config(tmp_path / "run", tiny_target(tmp_path / "target"))
    write_data_stage(config, random_samples(20, 512, seed=1, prefix="t"), [], vocab=512)
    result = run_python("03_build_vocab_map.py", "--config", str(path), "--set", "vocab.always_include=[511]",
                        timeout=300)
    assert result.returncode == 0, result.stderr
    assert "coverage" in result.stdout
    stage_dir = tmp_path / "run" / "03_vocab"
    tensors = load_file(str(stage_dir / "vocab.safetensors"))
    d2t, t2d = np.load(stage_dir / "d2t.npy"), np.load(stage_dir / "t2d.npy")
    assert np.array_equal(d2t, tensors["d2t"].numpy()) and np.array_equal(t2d, tensors["t2d"].numpy())
    assert d2t.dtype == np.int64 and t2d.dtype == bool and d2t.shape == (128,) and t2d.shape == (512,)
    target_ids = np.arange(128) + d2t
    assert np.all(np.diff(target_ids) > 0) and t2d[target_ids].all() and t2d.sum() == 128 and t2d[511]
    counts = read_manifest(stage_dir)["counts"]
    assert counts["draft_vocab_size"] == 128 and 0.5 < counts["coverage"] <= 1.0

    too_many = run_python("03_build_vocab_map.py", "--config", str(path), "--force",
                          "--set", f"vocab.always_include={list(range(129))}", timeout=300)
    assert too_many.returncode == 2 and len(too_many.stderr.strip().splitlines()) == 1
    assert "more than draft.draft_vocab_size" in too_many.stderr
