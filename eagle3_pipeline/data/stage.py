"""Stage 01: conversations -> a templated, tokenized, assistant-only loss-masked dataset.

Reads the sources in `data.sources` (training) and `data.eval_sources` (held-out prompts), lets the target
write what it has to (magpie user turns, regenerated answers) in resumable chunks, applies the target's
chat template and writes to `<run_dir>/01_data/`:

    train/, eval/, token_freq.safetensors, stats.json   the dataset, as dataset.py reads and describes it
    generated/               the target's turns, one file per finished chunk (what a rerun resumes from)
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.config_sections import DataConfig
from eagle3_pipeline.data.chat_template import ChatTemplate
from eagle3_pipeline.data.conversations import Conversation, InvalidConversation, Skips, image_sources
from eagle3_pipeline.data.dataset import STATS, TOKEN_FREQ
from eagle3_pipeline.data.generate import generate_turns
from eagle3_pipeline.data.samples import to_rows
from eagle3_pipeline.data.sources import load_conversations, source_labels
from eagle3_pipeline.data.stats import (
    generation_stats,
    loss_kinds_summary,
    reasoning_report,
    split_stats,
    token_frequencies,
)
from eagle3_pipeline.data.vision import Vision, read_image
from eagle3_pipeline.stage_io import Stage, StageError, write_json_atomic
from eagle3_pipeline.target import image_token_id, target_path, text_config


def run(config: RunConfig, force: bool = False) -> None:
    """Stage 01: read the sources, let the target write its turns, tokenize with its template, write 01_data."""
    stage = Stage(config, "01_data", force=force)
    if stage.is_complete():
        return
    data = config.data
    model_dir = target_path(config.target)
    template = ChatTemplate.for_target(config.target, model_dir, thinking=data.regenerate.thinking)
    skips = Skips()

    # Sources are read before the stage begins, so a missing file leaves no partial work behind. Eval
    # conversations are fixed before any generation: nothing of them can reach the train split.
    with stage.timed("read"):
        train, held_out = _read_sources(data, skips)
        image_token = image_token_id(model_dir)
        train, held_out = (_read_images(conversations, image_token is not None, skips) for conversations in
                           (train, held_out))
    print(f"01_data: {len(train)} train and {len(held_out)} eval conversations read; skipped so far: "
          f"{skips.summary() or 'none'}")
    vision = _vision(config, model_dir, image_token) if any(c.images for c in train + held_out) else None
    stage.begin()

    eval_ids = {c.id for c in held_out}
    with stage.timed("generate"):
        conversations, figures = generate_turns(stage, config, template, model_dir, train + held_out, skips, eval_ids,
                                                vision)
    if figures.tokens:
        print(f"01_data: generation: {figures.summary()}")
    train = [c for c in conversations if c.id not in eval_ids]
    held_out = [c for c in conversations if c.id in eval_ids]

    first_turns_only = [c.id for c in held_out if c.prompt_only and sum(m["role"] == "user" for m in c.messages) > 1]
    if first_turns_only:
        print(f"01_data: {len(first_turns_only)} eval conversations (first: {first_turns_only[0]}) are served through "
              "their first user turn only: later turns follow answers the target writes with data.regenerate.enabled")
    with stage.timed("tokenize"):
        train_rows = to_rows(train, template, data, with_prompt=False, skips=skips, split="train", vision=vision)
        eval_rows = to_rows(held_out, template, data, with_prompt=True, skips=skips, split="eval", vision=vision)
    if not train_rows:
        raise StageError(f"no valid training samples ({skips.summary() or 'the sources hold no records'})")
    if not eval_rows:
        print("warning: the eval split is empty (set data.eval_sources or data.eval_fraction): 06 has no prompts")

    stats = {
        "train": split_stats(train_rows, data.max_seq_len),
        "eval": split_stats(eval_rows, data.max_seq_len),
        "skipped": skips.as_dict(),
        "generation": generation_stats(conversations) | figures.as_dict(),
    }
    stats["reasoning"] = reasoning_report(template.opens_reasoning, train, stats["train"])
    print(f"01_data: train {len(train_rows)} samples, {stats['train']['tokens']} tokens "
          f"({stats['train']['tokens_per_sample']} a sample, loss-token fraction "
          f"{stats['train']['loss_token_fraction']}); eval {len(eval_rows)} samples; skipped {sum(skips.counts.values())}")
    print(f"01_data: train loss tokens by kind: {loss_kinds_summary(stats['train'])}")
    if stats["reasoning"]["warning"]:
        print(f"WARNING: {stats['reasoning']['warning']}")
    write_prepared(stage, train_rows, eval_rows, text_config(model_dir)["vocab_size"], stats)


def write_prepared(stage: Stage, train_rows: list[dict[str, Any]], eval_rows: list[dict[str, Any]], vocab_size: int,
                   stats: dict[str, Any]) -> None:
    """01's files from its tokenized rows (`samples.to_row`'s form), then its manifest: the one writer of a
    finished 01_data (stand_ins/fabricated_stages.py's come through here too)."""
    with stage.timed("write"):
        for split, rows in (("train", train_rows), ("eval", eval_rows)):
            _save_split(stage, split, rows)
            on_disk = sum(path.stat().st_size for path in stage.path(split).rglob("*") if path.is_file())
            stats[split]["bytes_per_sample"] = round(on_disk / len(rows)) if rows else 0
        _save_token_freq(stage, train_rows, vocab_size)
        write_json_atomic(stage.path(STATS), stats)
    stage.finish(counts={
        "train_samples": len(train_rows), "eval_samples": len(eval_rows),
        "train_tokens": stats["train"]["tokens"], "train_loss_tokens": stats["train"]["loss_tokens"],
        "skipped": sum(reason["count"] for reason in stats["skipped"].values()),
    })


def _read_sources(data: DataConfig, skips: Skips) -> tuple[list[Conversation], list[Conversation]]:
    """(train, eval) conversations: eval = the eval sources plus `eval_fraction` of the train sources."""
    sources = [*data.sources, *data.eval_sources]
    per_source = [load_conversations(s, label, skips) for s, label in zip(sources, source_labels(sources))]
    train = [c for conversations in per_source[: len(data.sources)] for c in conversations]
    held_out = [c for conversations in per_source[len(data.sources):] for c in conversations]
    n_held_out = round(len(train) * data.eval_fraction) if data.eval_fraction else 0
    if data.eval_fraction and train:
        n_held_out = max(1, n_held_out)
    chosen = set(random.Random(data.seed).sample(range(len(train)), n_held_out))
    held_out += [c for i, c in enumerate(train) if i in chosen]
    return [c for i, c in enumerate(train) if i not in chosen], held_out


def _read_images(conversations: list[Conversation], readable: bool, skips: Skips) -> list[Conversation]:
    """The conversations with their images' bytes; those with an unreadable image are skipped, and on a target
    that reads no images (`readable` false) every conversation holding one (images_unsupported)."""
    kept = []
    for conversation in conversations:
        sources = image_sources(conversation.messages)
        try:
            if sources and not readable:
                raise InvalidConversation("images_unsupported")
            kept.append(dataclasses.replace(conversation, images={source: read_image(source) for source in sources}))
        except InvalidConversation as err:
            skips.add(err.reason, conversation.id)
    return kept


def _vision(config: RunConfig, model_dir: Path, image_token: int) -> Vision:
    """vLLM's multimodal processor for the target: it says how many tokens each image becomes."""
    try:
        return Vision.offline(config.target, model_dir, image_token)
    except ImportError:
        raise StageError("conversations with images need vLLM (its multimodal processor for the target counts "
                         "their tokens): install it (make setup)") from None


def _save_split(stage: Stage, split: str, rows: list[dict[str, Any]]) -> None:
    import datasets

    token_ids = datasets.List(datasets.Value("int32"))
    features = {"id": datasets.Value("string"), "source": datasets.Value("string"), "input_ids": token_ids,
                "loss_mask": datasets.List(datasets.Value("int8")), "seq_len": datasets.Value("int32"),
                "images": datasets.List(datasets.Value("binary"))}
    if split == "eval":
        features["prompt_ids"] = token_ids
    columns = {name: [row[name] for row in rows] for name in features}
    dataset = datasets.Dataset.from_dict(columns, features=datasets.Features(features))
    with stage.atomic(split) as tmp:  # empty, datasets writes no data file and cannot load the folder back
        dataset.save_to_disk(str(tmp), num_shards=None if rows else 1)


def _save_token_freq(stage: Stage, rows: list[dict[str, Any]], vocab_size: int) -> None:
    from safetensors.numpy import save_file

    counts = token_frequencies(rows, vocab_size)
    if len(counts) != vocab_size:
        raise StageError(f"the tokenizer produced token id {len(counts) - 1}, beyond the target's vocab ({vocab_size})")
    with stage.atomic(TOKEN_FREQ) as tmp:
        save_file({"counts": counts}, str(tmp))
