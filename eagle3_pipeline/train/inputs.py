"""Stage 04's inputs: 01's splits, 02's states (or, with capture.mode stream, 02's stream), 03's vocabulary.

`read_inputs` opens them, checks that they fit together and the config, and plans the packs 04 trains and
evaluates on (pack_plan.py); `wait_for_states` holds 04 until 02 has opened its stream.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from eagle3_pipeline.capture.store import StatesLayout, open_reader
from eagle3_pipeline.capture.stream import (
    Consumer,
    Waiter,
    fetch_folder,
    largest_item_bytes,
    open_transport,
    shares_folder,
)
from eagle3_pipeline.config import ConfigError, RunConfig
from eagle3_pipeline.data.dataset import SPLITS, open_split
from eagle3_pipeline.pack_plan import PackStream, plan_packs, plan_settings, run_pack_stream, training_rows
from eagle3_pipeline.stage_io import Stage, StageError, read_proof, stream_identity
from eagle3_pipeline.train.data import PackedRows, StreamedRows
from eagle3_pipeline.vocab import load_draft_vocab


@dataclass
class Inputs:
    """What 04 reads, opened and checked, with the packs it trains and evaluates on."""

    train_rows: PackedRows
    eval_rows: PackedRows | None
    train_stream: PackStream
    eval_packs: list[tuple[int, ...]]
    layout: StatesLayout
    d2t: torch.Tensor
    t2d: torch.Tensor
    feed: Consumer | OfflineFeed  # where the train packs' states come from: 02's stream, or its finished shards
    eval_samples: list[dict]  # per eval row: source, seq_len, prompt_len (the served turn, acceptance.py)
    simulated_ks: list[int]  # validate.num_speculative_tokens, or [] when the eval answers are not greedy ones

    @property
    def num_aux(self) -> int:
        return len(self.layout.aux_layer_ids)


def read_inputs(stage: Stage, config: RunConfig) -> Inputs:
    """Open 01, 02 and 03 and check that they fit together and the config."""
    data_dir, states_dir = stage.input_dir("01_data"), stage.input_dir("02_hidden_states")
    splits = {name: open_split(data_dir, name) for name in SPLITS if (data_dir / name).is_dir()}
    reader, layout = open_reader(states_dir)
    if layout.hidden_size != config.draft.hidden_size:
        raise ConfigError(f"draft.hidden_size {config.draft.hidden_size} differs from the target's "
                          f"{layout.hidden_size} (02_hidden_states): EAGLE-3 needs them equal")
    rows = {name: training_rows(np.asarray(split["seq_len"], dtype=np.int64)) for name, split in splits.items()}
    consumer = stream_consumer(config, states_dir, layout)  # None offline
    # streaming, 02's shards hold the eval split only: the train split comes through the stream
    _check_fits({k: v for k, v in splits.items() if not consumer or k == "eval"}, rows, reader,
                config.train.packed_length)
    d2t, t2d = load_draft_vocab(stage.input_dir("03_vocab"))

    shape = {"capacity": config.train.packed_length, "hidden_size": layout.hidden_size,
             "aux_width": len(layout.aux_layer_ids) * layout.hidden_size}
    # eval rows of prompts alone (regeneration off) are 06's to serve; 04 evaluates what has loss tokens
    has_eval = "eval" in splits and any(any(mask) for mask in splits["eval"]["loss_mask"])
    eval_samples = served_samples(splits["eval"]) if has_eval else []
    return Inputs(
        train_rows=StreamedRows(splits["train"], states_dir, **shape, consumer=consumer, layout=layout) if consumer
        else PackedRows(splits["train"], states_dir, **shape),
        eval_rows=PackedRows(splits["eval"], states_dir, **shape) if has_eval else None,
        train_stream=run_pack_stream(config, splits["train"]["seq_len"]),
        eval_packs=plan_packs(rows["eval"], config.train.packed_length, seed=[config.train.seed]) if has_eval else [],
        layout=layout, d2t=d2t, t2d=t2d, feed=consumer or OfflineFeed(), eval_samples=eval_samples,
        simulated_ks=config.validate_.num_speculative_tokens if eval_samples and greedy_answers(config) else [],
    )


def greedy_answers(config: RunConfig) -> bool:
    """Whether the eval answers are the target's greedy continuations (what acceptance.py replays)."""
    return config.data.regenerate.enabled and config.data.regenerate.eval_temperature == 0


def served_samples(split) -> list[dict]:
    """Per eval row what acceptance.py needs; an older 01 without `prompt_ids` gives none (no simulation)."""
    if "prompt_ids" not in split.column_names:
        return []
    return [{"source": source, "seq_len": seq_len, "prompt_len": len(prompt)}
            for source, seq_len, prompt in zip(split["source"], split["seq_len"], split["prompt_ids"])]


# ----------------------------------------------------------------------------------------------- stream
class OfflineFeed:
    """02's finished shards: the stream's progress reports (capture.stream.Consumer) have no one to go to."""

    def advance(self, next_position: int, end: int, packs_per_step: int, step: int) -> None:
        pass

    def finish(self, end: int, packs_per_step: int, step: int) -> None:
        pass


def wait_for_states(config: RunConfig) -> None:
    """Before the input checks, with capture.mode stream: 02 opens its stream (stream.json) once its eval states
    are written. Offline, 02 is finished or the input checks say so."""
    if config.capture.mode != "stream":
        return
    states_dir = Path(config.run_dir) / "02_hidden_states"
    if read_proof(states_dir) is None and not shares_folder(config) and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        fetch_folder(config, states_dir, "04_train")  # one process per node fetches; the others wait for it below
    if read_proof(states_dir) is None:
        print(f"04_train: waiting for 02_generate_hidden_states.py to open its stream in {states_dir}", flush=True)
        Waiter(config.capture.stream, "04_train").wait(
            lambda: read_proof(states_dir), lambda: "02_hidden_states has not opened its stream yet",
            lambda: None, "start 02_generate_hidden_states.py with capture.mode stream")


def stream_consumer(config: RunConfig, states_dir: Path, layout: StatesLayout) -> Consumer | None:
    """04's side of 02's stream, checked against this run's pack plan; None offline."""
    if config.capture.mode != "stream":
        return None
    plan = (read_proof(states_dir) or {}).get("pack_plan")
    wanted = plan_settings(config)
    if plan != wanted:
        raise StageError(f"02_hidden_states streams packs for {plan}, this run packs {wanted} (train.packed_length, "
                         "train.seed): rerun 02_generate_hidden_states.py --force with this config")
    identity = stream_identity(states_dir)
    item_bytes = largest_item_bytes(config, layout.bytes_per_token)
    return Consumer(open_transport(config, identity, item_bytes), config.capture.stream, identity)


def _check_fits(splits: dict, rows: dict, reader, packed_length: int) -> None:
    longest = max(int(r.max(initial=0)) for r in rows.values())
    if longest > packed_length:
        raise ConfigError(f"train.packed_length {packed_length} is shorter than the longest sample "
                          f"({longest} rows = seq_len - 1): raise it or lower data.max_seq_len")
    missing = [i for split in splits.values() for i in split["id"] if i not in reader]
    if missing:
        raise StageError(f"02_hidden_states lacks {len(missing)} samples of 01_data (e.g. {missing[0]}): "
                         "finish 02_generate_hidden_states.py")
