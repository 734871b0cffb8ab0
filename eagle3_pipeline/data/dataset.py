"""Reading a finished 01_data (data/stage.py writes it): what stages 02, 03, 04 and 06, the benches and the
tests open.

    train/, eval/            Arrow datasets (save_to_disk), one row per sample:
                               id           string
                               source       string, the label of the data source it came from
                               input_ids    int32 list: the templated conversation, its images' placeholders
                                            expanded as vLLM expands them (vision.py)
                               loss_mask    int8 list, 1 where a token is learnt (the assistant's turns)
                               seq_len      int32, len(input_ids)
                               images       binary list: the file bytes of the sample's images, in order
                               prompt_ids   int32 list, eval only: the last turn's prompt (what 06 serves)
    token_freq.safetensors   `counts` int64 [target vocab]: loss-masked tokens of the train split (stage 03)
    stats.json               samples per source and split, skips per reason (first ids), length histogram,
                             loss-token fraction, loss tokens by kind (reasoning, answer, tool_call),
                             image tokens, generation figures
"""

from __future__ import annotations

import json
from pathlib import Path

SPLITS = ("train", "eval")
TOKEN_FREQ = "token_freq.safetensors"
STATS = "stats.json"


def open_split(data_dir: Path, split: str):
    """Split `split` (one of SPLITS) of the 01_data folder `data_dir`, a `datasets.Dataset`."""
    from datasets import load_from_disk  # imports pyarrow and more: only where a split is read

    return load_from_disk(str(Path(data_dir) / split))


def read_token_freq(data_dir: Path):
    """The loss-masked token counts of the train split, int64 [target vocab] (a torch tensor)."""
    from safetensors.torch import load_file

    return load_file(str(Path(data_dir) / TOKEN_FREQ))["counts"]


def read_stats(data_dir: Path) -> dict:
    return json.loads((Path(data_dir) / STATS).read_text())
