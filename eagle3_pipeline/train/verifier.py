"""The three target tensors the draft needs, read by name from the target checkpoint and nothing else.

The draft borrows the target's token embedding (its input), final norm and lm_head (the training targets are
the verifier's next-token distribution lm_head(norm(final hidden state))). Kimi-K2.5's checkpoint is 554 GB
in 64 shards, so the loader reads `model.safetensors.index.json` (or a single file's header), opens only the
shards holding these tensors and reads only them. Names carry `target.weight_prefix` (`language_model.` for
Kimi); a checkpoint without an lm_head tensor has tied embeddings, and the embedding serves as lm_head.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.target import text_config

INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
EMBED, NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


@dataclass(frozen=True)
class VerifierWeights:
    embed_tokens: torch.Tensor  # [V, H]
    norm: torch.Tensor  # [H]
    lm_head: torch.Tensor  # [V, H]
    norm_eps: float  # the target's rms_norm_eps: its final norm must be reproduced exactly
    tied: bool  # True when lm_head is the embedding


def load_verifier_weights(target_dir: Path, prefix: str) -> VerifierWeights:
    located = _tensor_files(target_dir)
    wanted = [EMBED, NORM] + ([LM_HEAD] if prefix + LM_HEAD in located else [])
    missing = [prefix + name for name in wanted if prefix + name not in located]
    if missing:
        raise StageError(f"{target_dir}: no tensor {', '.join(missing)} (is target.weight_prefix {prefix!r} right?)")
    by_file: dict[str, list[str]] = {}
    for name in wanted:
        by_file.setdefault(located[prefix + name], []).append(name)
    tensors = {}
    for file, names in sorted(by_file.items()):
        with safe_open(str(target_dir / file), "pt") as f:
            tensors |= {name: f.get_tensor(prefix + name) for name in names}
    tied = LM_HEAD not in tensors
    return VerifierWeights(
        embed_tokens=tensors[EMBED], norm=tensors[NORM], lm_head=tensors[EMBED if tied else LM_HEAD],
        norm_eps=text_config(target_dir)["rms_norm_eps"], tied=tied,
    )


def _tensor_files(target_dir: Path) -> dict[str, str]:
    """Tensor name -> the file holding it, from the index (sharded) or the one file's header."""
    if (target_dir / INDEX).is_file():
        return json.loads((target_dir / INDEX).read_text())["weight_map"]
    if (target_dir / SINGLE_FILE).is_file():
        with safe_open(str(target_dir / SINGLE_FILE), "pt") as f:
            return dict.fromkeys(f.keys(), SINGLE_FILE)
    raise StageError(f"{target_dir}: neither {INDEX} nor {SINGLE_FILE}; the target must be a safetensors checkpoint")
