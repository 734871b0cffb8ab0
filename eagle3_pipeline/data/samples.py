"""Conversations to dataset rows: templated token ids, the assistant-only loss mask, the length limit, images.

A conversation with images is laid out as vLLM prompts it: each image's placeholder token repeated as many
times as vLLM expands it (`vision.Vision`), never trained; the row keeps the images' file bytes. A sample
that `data.max_seq_len` would cut inside an image is skipped (`image_cut_by_max_seq_len`): vLLM cannot take
part of an image.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from tqdm import tqdm

from eagle3_pipeline.config_sections import DataConfig
from eagle3_pipeline.data.chat_template import KINDS, ChatTemplate
from eagle3_pipeline.data.conversations import (
    Conversation,
    InvalidConversation,
    Skips,
    image_sources,
    through_first_user_turn,
    up_to_last_answer,
)
from eagle3_pipeline.data.vision import Vision


def to_row(conversation: Conversation, template: ChatTemplate, data: DataConfig, with_prompt: bool,
           vision: Vision | None = None, last_turn_only: bool | None = None) -> dict[str, Any]:
    """One row (`truncated` tells whether `data.max_seq_len` cut it, `loss_tokens_by_kind` counts its trained
    tokens per kind for the report, `image_tokens` its image tokens); raises InvalidConversation. A conversation
    with images needs the target's `vision`.

    `with_prompt` (eval) adds `prompt_ids`: the conversation up to and including the generation prompt of its
    last assistant turn, which stage 06 replays; only that turn is in the loss mask (`served_turns` gives an
    earlier turn a row of its own). An eval conversation without an answer (a benchmark's prompt, kept as it
    is when regeneration is off) becomes its prompt alone, with no loss tokens: 06 serves it, 04 learns
    nothing from it. An eval row whose prompt does not fit is skipped. `last_turn_only` (default: `with_prompt`)
    trains the last assistant turn alone (`data.each_assistant_turn` rows)."""
    last_turn_only = with_prompt if last_turn_only is None else last_turn_only
    prompt_only = with_prompt and conversation.prompt_only
    if prompt_only:
        messages = through_first_user_turn(conversation.messages)
        layout = template.layout(messages, generation_prompt=True, tools=conversation.tools)
    else:
        messages = up_to_last_answer(conversation.messages)
        layout = template.layout(messages, tools=conversation.tools)
    segment_ids, loss_mask = template.encode(layout.segments)
    input_ids = [token for ids in segment_ids for token in ids]
    kinds = [segment.kind for segment, ids in zip(layout.segments, segment_ids) for _ in ids]
    prompt_len = sum(len(ids) for ids in segment_ids[: layout.prompt_end])
    images = [conversation.images[source] for source in image_sources(messages)]
    if images:
        (input_ids, loss_mask, kinds), prompt_len, images = _expand_images(
            vision, images, (input_ids, loss_mask, kinds), prompt_len, data.max_seq_len)
    if last_turn_only:  # the served turn alone: earlier answers are context
        loss_mask[:prompt_len], kinds[:prompt_len] = [0] * prompt_len, [None] * prompt_len
    truncated = len(input_ids) > data.max_seq_len
    if truncated and data.overlong == "drop":
        raise InvalidConversation("overlong")
    if with_prompt and (prompt_len >= data.max_seq_len or prompt_only and truncated):
        raise InvalidConversation("overlong_prompt")
    input_ids, loss_mask = input_ids[: data.max_seq_len], loss_mask[: data.max_seq_len]
    if not any(loss_mask) and not prompt_only:
        raise InvalidConversation("no_loss_tokens")
    row = {
        "id": conversation.id,
        "source": conversation.source,
        "input_ids": np.asarray(input_ids, dtype=np.int32),  # numpy: 5 bytes a token in memory, not ~70
        "loss_mask": np.asarray(loss_mask, dtype=np.int8),
        "seq_len": len(input_ids),
        "truncated": truncated,
        "loss_tokens_by_kind": {kind: kinds[: data.max_seq_len].count(kind) for kind in KINDS},
        "images": images,
        "image_tokens": input_ids.count(vision.token_id) if images else 0,
    }
    if with_prompt:
        row["prompt_ids"] = row["input_ids"][:prompt_len]
    return row


def served_turns(conversation: Conversation) -> list[Conversation]:
    """An eval conversation as 06 serves it: one conversation per assistant turn, through that turn, ids
    `<id>-turn<N>` when there are several (MT-Bench's two turns are two prompts, as the EAGLE papers count them)."""
    answers = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
    if len(answers) < 2:
        return [conversation]
    return [dataclasses.replace(conversation, id=f"{conversation.id}-turn{n}", messages=conversation.messages[: i + 1])
            for n, i in enumerate(answers, start=1)]


def _expand_images(vision: Vision, images: list[bytes], columns: tuple[list, ...], prompt_len: int,
                   max_len: int) -> tuple[list[list], int, list[bytes]]:
    """`columns` (ids first) with each image's placeholder repeated as vLLM expands it, the prompt length after
    expansion, and the images whose tokens all lie within `max_len`."""
    repeats = vision.repeats(columns[0], images)
    starts = np.cumsum([0, *repeats])  # where each templated token begins once expanded
    placeholders = [i for i, token in enumerate(columns[0]) if token == vision.token_id]
    if any(starts[i] < max_len < starts[i + 1] for i in placeholders):
        raise InvalidConversation("image_cut_by_max_seq_len")
    kept = [image for i, image in zip(placeholders, images) if starts[i + 1] <= max_len]
    return [[x for x, n in zip(column, repeats) for _ in range(n)] for column in columns], int(starts[prompt_len]), kept


def to_rows(conversations: list[Conversation], template: ChatTemplate, data: DataConfig, with_prompt: bool,
            skips: Skips, split: str, vision: Vision | None = None) -> list[dict[str, Any]]:
    """The rows of `conversations`: eval ones (`with_prompt`) one per served turn; training ones one per
    conversation, or one per assistant turn with `data.each_assistant_turn`."""
    per_turn = with_prompt or data.each_assistant_turn
    rows = []
    for conversation in tqdm(conversations, desc=f"tokenize {split}", unit="conv"):
        for turn in served_turns(conversation) if per_turn else [conversation]:
            try:
                rows.append(to_row(turn, template, data, with_prompt, vision, last_turn_only=per_turn))
            except InvalidConversation as err:
                skips.add(err.reason, turn.id)
    return rows
