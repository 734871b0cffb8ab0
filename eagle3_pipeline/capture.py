"""Stage 02: the target's hidden states for every sample of stage 01, as verified safetensors shards.

Work is cut into shards of `capture.samples_per_shard` samples in a fixed order (train, then eval). Job
`i` of `N` (`--shard-index i --num-shards N`) takes shards k with k % N == i, so independent jobs split the
work with no overlap and no coordination. A shard counts as done only once its file verifies (readable,
expected tokens, shapes, dtype) and its index part is written; a rerun skips done shards and redoes the
rest. The job that finds every shard done writes `index.json` and the manifest.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from eagle3_pipeline import hidden_states_store as store
from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.stage_io import Stage, StageError, write_json_atomic
from eagle3_pipeline.stand_ins import target_path

LAYER_ID_CONVENTION = (
    "vLLM: aux id i is the residual stream entering decoder layer i (hidden_states + residual), equal to "
    "Hugging Face output_hidden_states[i]; `final` is the last decoder layer's output before the final norm"
)
SPLITS = ("train", "eval")


@dataclass(frozen=True)
class Sample:
    sample_id: str
    split: str
    input_ids: list[int]


@dataclass(frozen=True)
class ShardPlan:
    number: int
    samples: list[Sample]

    @property
    def file(self) -> str:
        return f"shard_{self.number:05d}.safetensors"

    @property
    def tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.samples)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: one early, one middle, one late layer (vLLM's and speculators' choice)."""
    return [2, num_layers // 2, num_layers - 3]


def target_text_config(model_dir: Path) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    return config.get("text_config", config)  # Kimi-K2.5 nests its DeepSeek-V3 text model


def load_samples(data_dir: Path) -> list[Sample]:
    from datasets import load_from_disk

    samples = []
    for split in SPLITS:
        dataset = load_from_disk(str(data_dir / split)).select_columns(["id", "input_ids"])
        samples += [Sample(row["id"], split, list(row["input_ids"])) for row in dataset]
    return samples


def plan_shards(samples: list[Sample], samples_per_shard: int) -> list[ShardPlan]:
    return [
        ShardPlan(k, samples[start : start + samples_per_shard])
        for k, start in enumerate(range(0, len(samples), samples_per_shard))
    ]


def shard_is_done(stage: Stage, plan: ShardPlan, num_aux: int, hidden_size: int, dtype: str) -> bool:
    part = stage.path(plan.file + ".json")
    if not part.exists():
        return False
    return store.verify_shard(stage.path(plan.file), plan.tokens, num_aux, hidden_size, dtype) is None


def check_disk(stage: Stage, tokens: int, per_token: int, ignore: bool) -> None:
    needed = tokens * per_token
    free = shutil.disk_usage(stage.dir).free
    print(f"disk: {tokens:,} tokens x {per_token:,} B/token = {needed / 2**30:.2f} GiB needed, {free / 2**30:.1f} GiB free")
    if needed > free and not ignore:
        raise StageError(f"{stage.dir}: not enough free disk ({free / 2**30:.1f} GiB < {needed / 2**30:.2f} GiB); "
                         "free space, or pass --ignore-disk-check")


def run(config: RunConfig, force: bool = False, shard_index: int = 0, num_shards: int = 1,
        ignore_disk_check: bool = False) -> None:
    stage = Stage(config, "02_hidden_states", force=force)
    if stage.is_complete():
        return
    stage.begin()

    # What to capture: the aux layers, plus the final layer output the training targets need.
    model_dir = target_path(config.target)
    text_config = target_text_config(model_dir)
    num_layers, hidden_size = text_config["num_hidden_layers"], text_config["hidden_size"]
    aux_layer_ids = config.capture.aux_layer_ids or default_aux_layer_ids(num_layers)
    if max(aux_layer_ids) >= num_layers:
        raise StageError(f"capture.aux_layer_ids {aux_layer_ids}: the target has {num_layers} layers (ids 0..{num_layers - 1})")
    dtype = config.capture.dtype
    print(f"aux layers {aux_layer_ids} + final (layer {num_layers} output), hidden {hidden_size}, {dtype}")

    with stage.timed("load_samples"):
        plans = plan_shards(load_samples(stage.input_dir("01_data")), config.capture.samples_per_shard)
    mine = [p for p in plans if p.number % num_shards == shard_index]
    todo = [p for p in mine if not shard_is_done(stage, p, len(aux_layer_ids), hidden_size, dtype)]
    per_token = store.bytes_per_token(len(aux_layer_ids), hidden_size, dtype)
    print(f"shards: {len(plans)} in all, {len(mine)} for job {shard_index}/{num_shards}, {len(todo)} to capture")
    check_disk(stage, sum(p.tokens for p in todo), per_token, ignore_disk_check)

    if todo:
        with stage.timed("capture"):
            capture_shards(stage, config, model_dir, text_config, todo, aux_layer_ids)

    missing = [p.file for p in plans if not shard_is_done(stage, p, len(aux_layer_ids), hidden_size, dtype)]
    if missing:
        print(f"job {shard_index}/{num_shards} done; {len(missing)} shards of other jobs still missing "
              f"(the job that completes the last one writes the index)")
        return
    write_index_and_finish(stage, plans, aux_layer_ids, num_layers, hidden_size, per_token)


def capture_shards(stage: Stage, config: RunConfig, model_dir: Path, text_config: dict, todo: list[ShardPlan],
                   aux_layer_ids: list[int]) -> None:
    from eagle3_pipeline.capture_engine import open_capturer  # imports vLLM: only where it is needed

    hidden_size = text_config["hidden_size"]
    capturer = open_capturer(config, model_dir, text_config, aux_layer_ids)
    batch_size = config.capture.batch_size
    total_tokens, started = sum(p.tokens for p in todo), time.perf_counter()
    with tqdm(total=total_tokens, unit="tok", desc="capture") as progress:
        for plan in todo:
            captured = []
            for start in range(0, len(plan.samples), batch_size):
                batch = plan.samples[start : start + batch_size]
                for sample, (aux, final) in zip(batch, capturer.capture([s.input_ids for s in batch])):
                    if aux.shape != (len(sample.input_ids), len(aux_layer_ids), hidden_size):
                        raise StageError(f"sample {sample.sample_id}: captured aux {tuple(aux.shape)} does not match "
                                         f"{len(sample.input_ids)} tokens x {len(aux_layer_ids)} layers x {hidden_size}")
                    captured.append(store.SampleStates(sample.sample_id, aux, final))
                progress.update(sum(len(s.input_ids) for s in batch))
            entries = store.write_shard(stage.path(plan.file), captured, config.capture.dtype)
            problem = store.verify_shard(stage.path(plan.file), plan.tokens, len(aux_layer_ids), hidden_size,
                                         config.capture.dtype)
            if problem:
                raise StageError(f"shard failed verification after writing: {problem}")
            splits = {s.sample_id: s.split for s in plan.samples}
            write_json_atomic(stage.path(plan.file + ".json"),
                              {k: {**asdict(v), "split": splits[k]} for k, v in entries.items()})
    elapsed = time.perf_counter() - started
    print(f"captured {total_tokens:,} tokens in {elapsed:.1f} s ({total_tokens / elapsed:,.0f} tokens/s)")


def write_index_and_finish(stage: Stage, plans: list[ShardPlan], aux_layer_ids: list[int], num_layers: int,
                           hidden_size: int, per_token: int) -> None:
    entries, splits = {}, {}
    for plan in plans:
        for sample_id, part in json.loads(stage.path(plan.file + ".json").read_text()).items():
            splits[sample_id] = part.pop("split")
            entries[sample_id] = store.IndexEntry(**part)
    layout = {
        "aux_layer_ids": aux_layer_ids,
        "final_layer_id": num_layers,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "hidden_size": hidden_size,
        "dtype": stage.config.capture.dtype,
        "splits": splits,
    }
    store.write_index(stage.dir, entries, layout)
    tokens = sum(p.tokens for p in plans)
    stage.finish(
        counts={"samples": len(entries), "shards": len(plans), "tokens": tokens,
                "bytes_on_disk": sum(stage.path(p.file).stat().st_size for p in plans)},
        extra={"layout": {k: v for k, v in layout.items() if k != "splits"}, "bytes_per_token": per_token},
    )
