"""The verifier loader reads embed_tokens, the final norm and lm_head by name, and nothing else."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.train import verifier
from tests.train.fabricate import tiny_target


@pytest.fixture
def opened(monkeypatch):
    """Records the files the loader opens and (file, tensor) for every tensor it reads."""
    reads: list[tuple[str, str]] = []
    files: list[str] = []

    class RecordingHandle:
        def __init__(self, path, framework):
            self.path, self.handle = path, safe_open(path, framework)
            files.append(path.rsplit("/", 1)[-1])

        def __enter__(self):
            self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, name):
            reads.append((self.path.rsplit("/", 1)[-1], name))
            return self.handle.get_tensor(name)

    monkeypatch.setattr(verifier, "safe_open", RecordingHandle)
    return SimpleNamespace(reads=reads, files=files)


def test_sharded_prefixed_checkpoint_reads_only_the_three_tensors(tmp_path, opened):
    folder = tiny_target(tmp_path / "kimi_like", prefix="language_model.", shards=3)
    weight_map = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    weights = verifier.load_verifier_weights(folder, "language_model.")
    wanted = [f"language_model.{name}" for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")]
    assert sorted(opened.reads) == sorted((weight_map[name], name) for name in wanted)
    decoy_shard = weight_map["language_model.model.layers.0.mlp.down_proj.weight"]
    assert decoy_shard not in opened.files and len(opened.files) == len(set(opened.files)) == 2
    assert not weights.tied and weights.norm_eps == pytest.approx(1e-5)
    assert weights.embed_tokens.shape == weights.lm_head.shape == (512, 64)
    assert not torch.equal(weights.embed_tokens, weights.lm_head)


def test_tied_single_file_checkpoint_uses_the_embedding_as_lm_head(tmp_path, opened):
    folder = tiny_target(tmp_path / "smollm_like", tied=True)
    weights = verifier.load_verifier_weights(folder, "")
    assert sorted(name for _, name in opened.reads) == ["model.embed_tokens.weight", "model.norm.weight"]
    assert weights.tied and weights.lm_head is weights.embed_tokens


def test_wrong_prefix_names_the_missing_tensors(tmp_path):
    folder = tiny_target(tmp_path / "kimi_like", prefix="language_model.", shards=2)
    missing = r"no tensor model\.embed_tokens\.weight, model\.norm\.weight .*weight_prefix ''"
    with pytest.raises(StageError, match=missing):
        verifier.load_verifier_weights(folder, "")


def test_smollm2_stand_in_is_tied(smollm2_dir):
    weights = verifier.load_verifier_weights(smollm2_dir, "")
    assert weights.tied and weights.embed_tokens.shape == (49152, 576) and weights.norm_eps == pytest.approx(1e-5)


def test_tiny_kimi_stand_in_reads_three_tensors_from_its_shards(tiny_kimi_dir, opened):
    weights = verifier.load_verifier_weights(tiny_kimi_dir, "language_model.")
    assert sorted(name for _, name in opened.reads) == [
        "language_model.lm_head.weight", "language_model.model.embed_tokens.weight", "language_model.model.norm.weight"]
    assert not weights.tied and weights.lm_head.shape == (163840, 256)
