"""What stage 01 reports about its dataset (stats.json) and the token counts stage 03 builds the vocab from."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from eagle3_pipeline.acceptance import AcceptanceCounts
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
        "tokens_per_sample": round(tokens / len(rows), 1) if rows else 0.0,
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


@dataclass
class GenerationFigures:
    """The generation this run did (a resumed run: the chunks it generated): tokens the target wrote, seconds
    inside vLLM's generate, and with a draft (data.regenerate.speculative) vLLM's spec-decode counters over them."""

    tokens: int = 0
    seconds: float = 0.0
    acceptance: AcceptanceCounts | None = None

    def add(self, outputs: list, seconds: float) -> None:
        self.tokens += sum(len(output.outputs[0].token_ids) for output in outputs)
        self.seconds += seconds

    def as_dict(self) -> dict[str, Any]:
        figures = {"tokens_generated": self.tokens, "generate_seconds": round(self.seconds, 3),
                   "tokens_per_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0}
        if self.acceptance is not None:
            counts = self.acceptance
            figures["speculative"] = {
                "num_speculative_tokens": counts.k, **counts.vllm_counters(),
                "mean_acceptance_length": round(counts.mean_acceptance_length, 4),
                "acceptance_per_position": [round(rate, 4) for rate in counts.acceptance_per_position]}
        return figures

    def summary(self) -> str:
        line = f"{self.tokens} tokens generated in {self.seconds:.1f} s ({self.as_dict()['tokens_per_s']} tokens/s)"
        if self.acceptance is not None:
            rates = ", ".join(f"{rate:.3f}" for rate in self.acceptance.acceptance_per_position)
            line += (f"; draft: mean acceptance length {self.acceptance.mean_acceptance_length:.3f} over "
                     f"{self.acceptance.drafts} drafts (k={self.acceptance.k}), per position {rates}")
        return line


REASONING_FAR_BELOW = 0.5  # a trained reasoning share under half the source data's is reported as a warning


def reasoning_report(template_thinks: bool, conversations: list[Conversation], train: dict[str, Any]) -> dict[str, Any]:
    """The reasoning share of what 01 trains (loss tokens) against that of the training conversations it read or
    generated (characters of their answers' reasoning over reasoning and content), and a warning when a thinking
    template's draft would learn little or no reasoning."""
    answers = [m for c in conversations for m in c.messages if m["role"] == "assistant"]
    reasoning = sum(len(m.get("reasoning_content", "")) for m in answers)
    written = reasoning + sum(len(m["content"]) for m in answers if isinstance(m["content"], str))
    source_share = reasoning / written if written else 0.0
    trained_share = train["loss_tokens_by_kind"]["reasoning"] / train["loss_tokens"] if train["loss_tokens"] else 0.0
    warning = None
    if template_thinks and source_share == 0:
        warning = ("the target's template thinks (its generation prompt opens <think>) but the training answers hold "
                   "no reasoning: the draft will not learn the reasoning the target writes first; regenerate the "
                   "answers (data.regenerate.enabled) or bring data with reasoning")
    elif template_thinks and trained_share < REASONING_FAR_BELOW * source_share:
        warning = (f"the training answers are {source_share:.0%} reasoning but only {trained_share:.0%} of the trained "
                   "tokens are: the template drops the reasoning of earlier turns; data.each_assistant_turn trains "
                   "each turn as served, its reasoning included")
    return {"template_thinks": template_thinks, "source_share_characters": round(source_share, 4),
            "trained_share_tokens": round(trained_share, 4), "warning": warning}


def loss_kinds_summary(split: dict[str, Any]) -> str:
    """What the draft will learn: loss tokens per kind with their share, and the image tokens in the inputs."""
    total = split["loss_tokens"] or 1
    by_kind = split["loss_tokens_by_kind"]
    kinds = ", ".join(f"{kind} {by_kind[kind]} ({by_kind[kind] / total:.1%})" for kind in KINDS)
    return f"{kinds}; image tokens {split['image_tokens']}"
