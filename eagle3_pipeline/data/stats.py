"""What stage 01 reports about its dataset (stats.json) and the token counts stage 03 builds the vocab from."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from eagle3_pipeline.data.chat_template import KINDS
from eagle3_pipeline.data.conversations import Conversation


def split_stats(rows: list[dict[str, Any]], max_seq_len: int) -> dict[str, Any]:
    lengths = np.array([row["seq_len"] for row in rows], dtype=np.int64)
    tokens = int(lengths.sum())
    loss_tokens = int(sum(int(row["loss_mask"].sum()) for row in rows))
    return {
        "samples": len(rows),
        "per_source": dict(Counter(row["source"] for row in rows)),
        "tokens": tokens,
        "loss_tokens": loss_tokens,
        "loss_token_fraction": round(loss_tokens / tokens, 4) if tokens else 0.0,
        "loss_tokens_by_kind": {kind: sum(row["loss_tokens_by_kind"][kind] for row in rows) for kind in KINDS},
        "image_tokens": sum(row["image_tokens"] for row in rows),  # in the inputs, never trained
        "truncated": sum(row["truncated"] for row in rows),
        "seq_len_histogram": length_histogram(lengths, max_seq_len),
    }


def length_histogram(lengths: np.ndarray, max_seq_len: int) -> dict[str, list[int]]:
    """Samples per length bucket: counts[i] have upper_edges[i-1] < seq_len <= upper_edges[i] (powers of two)."""
    edges = [0, 32]
    while edges[-1] < max_seq_len:
        edges.append(min(edges[-1] * 2, max_seq_len))
    counts, _ = np.histogram(lengths, bins=np.array(edges) + 0.5)
    return {"upper_edges": edges[1:], "counts": counts.tolist()}


def token_frequencies(rows: list[dict[str, Any]], vocab_size: int) -> np.ndarray:
    """How often each target token id is a loss-masked (trained) token."""
    trained = np.concatenate([row["input_ids"][row["loss_mask"] == 1] for row in rows])
    return np.bincount(trained, minlength=vocab_size).astype(np.int64)


def generation_stats(conversations: list[Conversation]) -> dict[str, int]:
    """Answers the target wrote here, and those cut by max_tokens before their end-of-turn token."""
    written = [m for c in conversations for m in c.messages if "completion" in m]
    return {"answers_generated": len(written), "answers_cut_by_max_tokens": sum(not m["finished"] for m in written)}


def loss_kinds_summary(split: dict[str, Any]) -> str:
    """What the draft will learn: loss tokens per kind with their share, and the image tokens in the inputs."""
    total = split["loss_tokens"] or 1
    by_kind = split["loss_tokens_by_kind"]
    kinds = ", ".join(f"{kind} {by_kind[kind]} ({by_kind[kind] / total:.1%})" for kind in KINDS)
    return f"{kinds}; image tokens {split['image_tokens']}"
