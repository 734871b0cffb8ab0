"""Conversations to dataset rows: templated token ids, the assistant-only loss mask, the length limit."""

from __future__ import annotations

from typing import Any

import numpy as np
from tqdm import tqdm

from eagle3_pipeline.config import DataConfig
from eagle3_pipeline.data.chat_template import KINDS, ChatTemplate
from eagle3_pipeline.data.conversations import Conversation, InvalidConversation, Skips, up_to_last_answer


def to_row(conversation: Conversation, template: ChatTemplate, data: DataConfig, with_prompt: bool) -> dict[str, Any]:
    """One row (`truncated` tells whether `data.max_seq_len` cut it, `loss_tokens_by_kind` counts its trained
    tokens per kind for the report); raises InvalidConversation.

    `with_prompt` (eval) adds `prompt_ids`: the conversation up to and including the generation prompt of its
    last assistant turn, which stage 06 replays; an eval row whose prompt does not fit is skipped."""
    layout = template.layout(up_to_last_answer(conversation.messages), tools=conversation.tools)
    segment_ids, loss_mask = template.encode(layout.segments)
    input_ids = [token for ids in segment_ids for token in ids]
    kinds = [segment.kind for segment, ids in zip(layout.segments, segment_ids) for _ in ids]
    prompt_len = sum(len(ids) for ids in segment_ids[: layout.prompt_end])
    truncated = len(input_ids) > data.max_seq_len
    if truncated and data.overlong == "drop":
        raise InvalidConversation("overlong")
    if with_prompt and prompt_len >= data.max_seq_len:
        raise InvalidConversation("overlong_prompt")
    input_ids, loss_mask = input_ids[: data.max_seq_len], loss_mask[: data.max_seq_len]
    if not any(loss_mask):
        raise InvalidConversation("no_loss_tokens")
    row = {
        "id": conversation.id,
        "source": conversation.source,
        "input_ids": np.asarray(input_ids, dtype=np.int32),  # numpy: 5 bytes a token in memory, not ~70
        "loss_mask": np.asarray(loss_mask, dtype=np.int8),
        "seq_len": len(input_ids),
        "truncated": truncated,
        "loss_tokens_by_kind": {kind: kinds[: data.max_seq_len].count(kind) for kind in KINDS},
    }
    if with_prompt:
        row["prompt_ids"] = row["input_ids"][:prompt_len]
    return row


def to_rows(conversations: list[Conversation], template: ChatTemplate, data: DataConfig, with_prompt: bool,
            skips: Skips, split: str) -> list[dict[str, Any]]:
    rows = []
    for conversation in tqdm(conversations, desc=f"tokenize {split}", unit="conv"):
        try:
            rows.append(to_row(conversation, template, data, with_prompt))
        except InvalidConversation as err:
            skips.add(err.reason, conversation.id)
    return rows
