"""Stage 03: the draft vocabulary, the `draft.draft_vocab_size` target tokens the draft can propose.

The draft's lm_head covers only K target tokens (32000 of Kimi's 163840), which cuts its cost by 5x and loses
little: the K most frequent loss-masked tokens cover almost every token the target generates. Selection
(the same as speculators' `build_vocab_mappings_from_distribution` when nothing is forced):

- `vocab.always_include` ids are kept whatever their count (EOS, `<|im_end|>`, `<think>`, ...);
- the rest are the most frequent loss-masked train tokens, ties broken by the lower id; when fewer than K
  distinct tokens were seen, the unseen ones with the lowest ids pad the vocabulary;
- the kept ids are sorted, so draft id i maps to the i-th smallest kept target id.

Outputs (`03_vocab/`):
    vocab.safetensors   d2t int64 [K] (target_id = draft_id + d2t[draft_id]), t2d bool [V] (True for kept ids)
    d2t.npy, t2d.npy    the same arrays, in the files speculators' trainer reads (--d2t-path, --t2d-path)
    manifest.json       counts: draft/target vocab size, coverage of loss-masked train tokens
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.config import ConfigError, RunConfig
from eagle3_pipeline.data.dataset import TOKEN_FREQ, read_token_freq
from eagle3_pipeline.stage_io import Stage, StageError

VOCAB_FILE = "vocab.safetensors"


@dataclass(frozen=True)
class DraftVocab:
    d2t: torch.Tensor  # [K] int64 offsets
    t2d: torch.Tensor  # [V] bool
    coverage: float  # fraction of loss-masked train tokens whose id is kept

    @property
    def target_ids(self) -> torch.Tensor:
        return torch.arange(len(self.d2t)) + self.d2t


def select_draft_vocab(counts: torch.Tensor, draft_vocab_size: int, always_include: list[int]) -> DraftVocab:
    """Keep `always_include`, then the most frequent ids (ties: lower id first) up to `draft_vocab_size`."""
    vocab_size = counts.numel()
    if draft_vocab_size > vocab_size:
        raise ConfigError(f"draft.draft_vocab_size {draft_vocab_size} exceeds the target vocabulary ({vocab_size})")
    forced = sorted(set(always_include))
    if forced and (forced[0] < 0 or forced[-1] >= vocab_size):
        raise ConfigError(f"vocab.always_include: ids must lie in [0, {vocab_size}), got {forced}")
    if len(forced) > draft_vocab_size:
        raise ConfigError(f"vocab.always_include has {len(forced)} ids, more than draft.draft_vocab_size")
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[forced] = True
    # A stable sort on -count keeps equal counts in id order: ties go to the lower id.
    by_frequency = torch.sort(-counts, stable=True).indices
    rest = by_frequency[~keep[by_frequency]][: draft_vocab_size - len(forced)]
    keep[rest] = True
    kept_ids = keep.nonzero().squeeze(1)  # ascending
    total = int(counts.sum())
    coverage = float(counts[kept_ids].sum()) / total if total else 0.0
    return DraftVocab(d2t=kept_ids - torch.arange(draft_vocab_size), t2d=keep, coverage=coverage)


def load_draft_vocab(vocab_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) as stage 03 wrote them."""
    tensors = load_file(str(vocab_dir / VOCAB_FILE))
    return tensors["d2t"], tensors["t2d"]


def run(config: RunConfig, force: bool = False) -> None:
    """Stage 03: the draft vocabulary from 01's loss-masked token counts; d2t, t2d and the coverage."""
    stage = Stage(config, "03_vocab", force=force)
    if stage.is_complete():
        return
    stage.check_inputs()
    data_dir = stage.input_dir("01_data")
    try:
        counts = read_token_freq(data_dir).to(torch.int64)
    except (OSError, KeyError) as err:
        raise StageError(f"{data_dir / TOKEN_FREQ}: cannot read tensor `counts` ({err}); rerun 01_prepare_data.py --force") \
            from None

    vocab = select_draft_vocab(counts, config.draft.draft_vocab_size, config.vocab.always_include)
    stage.begin()  # after the config checks of the selection: a refused config leaves nothing to --force
    seen = int((counts > 0).sum())
    print(f"03_vocab: {seen} distinct loss-masked tokens seen ({int(counts.sum())} in all); keeping "
          f"{len(vocab.d2t)} of {counts.numel()}; coverage {vocab.coverage:.2%} of loss-masked train tokens")

    with stage.atomic(VOCAB_FILE) as tmp:
        save_file({"d2t": vocab.d2t.contiguous(), "t2d": vocab.t2d.contiguous()}, str(tmp))
    for name, tensor in (("d2t.npy", vocab.d2t), ("t2d.npy", vocab.t2d)):
        with stage.atomic(name) as tmp, open(tmp, "wb") as f:  # np.save(path) would append .npy to tmp
            np.save(f, tensor.numpy())
    stage.finish(counts={
        "draft_vocab_size": len(vocab.d2t),
        "target_vocab_size": counts.numel(),
        "distinct_tokens_seen": seen,
        "loss_masked_tokens": int(counts.sum()),
        "coverage": round(vocab.coverage, 6),
    })
