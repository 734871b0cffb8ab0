"""speculators 0.9.0's own trainer (`speculators train`) on our stage 01-03 outputs (bench/quality.py and
bench/quality_gpu.py train with it).

`write_dataset(shared_run_dir, out_dir)` writes our data as `speculators train --data-path` reads it (what its
`prepare_data` + `generate_offline_data` would write): out_dir/, a `datasets` folder (torch format: input_ids,
loss_mask int64, seq_len) of our 01 train split then our 01 eval split, so that its own `--train-data-ratio`
split puts exactly our train split in training and our eval split in its validation; out_dir/hidden_states/
hs_<row>.safetensors: token_ids [T] and hidden_states [T, 4, H] = our 02 aux states (vLLM layer ids) + final
state, bf16 as captured. d2t / t2d are not copied: `--d2t-path/--t2d-path` point at our 03_vocab.

Run as a script, it is `speculators train <args>` (the same `main(TrainConfig.resolve(argv))` the CLI calls),
every record its `speculators.metrics` logger emits appended to `<save_path>/../metrics.jsonl`, and, without an
accelerator (its trainer assumes one), these workarounds applied from the outside:

    .venv/bin/python -m bench.speculators_trainer --verifier-name-or-path ... --data-path ... [...]

- `Trainer` moves the model and batches to `get_local_rank()` (the integer 0, i.e. cuda:0): patched to return "cpu";
- `Trainer.device_type` falls back to "cuda" (autocast on the wrong device): set to "cpu";
- `_StepTimer` calls `torch.accelerator.synchronize()`, which raises without an accelerator: made a no-op.
The flags its defaults need on the machine are `device_flags()`'s (the callers record them).
`--bench-train-lm-head` (ours, not speculators'; ablations only) trains its lm_head as ours does.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
from pathlib import Path

import torch

from bench.harness import save


def write_dataset(shared_run_dir: Path, out_dir: Path) -> dict:
    """Our 01 train + eval splits and 02 states as speculators' offline training data. Returns facts about it
    (rows per split, the `--train-data-ratio` that puts exactly our train split in training)."""
    import datasets
    from safetensors.torch import save_file

    from eagle3_pipeline.capture.store import open_reader
    from eagle3_pipeline.data.dataset import SPLITS, open_split

    done = out_dir / "bench_dataset.json"
    if done.exists():
        return json.loads(done.read_text())
    splits = [open_split(shared_run_dir / "01_data", name) for name in SPLITS]
    reader, layout = open_reader(shared_run_dir / "02_hidden_states")
    (out_dir / "hidden_states").mkdir(parents=True, exist_ok=True)
    rows = {"input_ids": [], "loss_mask": [], "seq_len": [], "id": []}
    for sample in (sample for split in splits for sample in split):
        ids = torch.tensor(sample["input_ids"], dtype=torch.long)
        aux, final = reader.get(sample["id"])
        if aux.shape[0] != len(ids):
            raise RuntimeError(f"{sample['id']}: {len(ids)} tokens but {aux.shape[0]} captured states")
        states = torch.cat([aux, final.unsqueeze(1)], dim=1).to(torch.bfloat16).contiguous()  # [T, 4, H]
        path = out_dir / "hidden_states" / f"hs_{len(rows['id'])}.safetensors"
        save_file({"token_ids": ids, "hidden_states": states}, str(path))
        for key, value in (("input_ids", ids.tolist()), ("loss_mask", [int(m) for m in sample["loss_mask"]]),
                           ("seq_len", len(ids)), ("id", sample["id"])):
            rows[key].append(value)
    dataset = datasets.Dataset.from_dict(rows, features=datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int64")),
        "loss_mask": datasets.Sequence(datasets.Value("int64")),  # speculators' prepare_data writes int64
        "seq_len": datasets.Value("int64"),
        "id": datasets.Value("string"),
    }))
    dataset.set_format(type="torch")  # what speculators' prepare_data saves; its dataset compares tensors
    dataset.save_to_disk(str(out_dir))
    n_train, n_eval = len(splits[0]), len(splits[1])
    # ArrowDataset splits at int(N * ratio): (n_train + 0.5) / N lands on n_train exactly
    facts = {"train_rows": n_train, "eval_rows": n_eval, "train_data_ratio": (n_train + 0.5) / (n_train + n_eval),
             "aux_layer_ids": layout.aux_layer_ids}
    save(done, facts)
    return facts


def train_batches(data_dir: Path, total_seq_len: int, train_data_ratio: float, seed: int, epochs: int) -> list[int]:
    """Rows (tokens after its one-token shift) of every training batch speculators' sampler makes, epoch after
    epoch: the same `MultipackDistributedBatchSamplerV2` its dataloader uses, on the same lengths."""
    import datasets
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    from eagle3_pipeline.pack_plan import training_rows

    lengths = list(datasets.load_from_disk(str(data_dir)).with_format(None)["seq_len"])
    lengths = lengths[: int(len(lengths) * train_data_ratio)]
    sampler = MultipackDistributedBatchSamplerV2(batch_max_length=total_seq_len, lengths=lengths, num_replicas=1,
                                                 rank=0, seed=seed)
    rows = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        rows += [sum(training_rows(min(lengths[i], total_seq_len)) for i in batch) for batch in sampler]
    return rows


def device_flags() -> list[str]:
    """The `speculators train` flags its defaults need on this machine."""
    if torch.cuda.is_available():
        # its fused loss is a Triton kernel that fails under torch 2.11 (bench/train_throughput.py); the loader's
        # processes are capped so that several trainings share the node's cores
        return ["--loss-implementation", "eager", "--num-workers", "4"]
    # CPU: flex attention has no CPU backward, the fused loss is a Triton kernel, 2 cores, fp32 as ours
    return ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
            "--hidden-states-dtype", "float32"]


def outputs(run_dir: Path) -> dict:
    """What a finished `speculators train` left in `run_dir`: its last checkpoint copied to export/, its own
    validation figures and resolved config."""
    checkpoints = sorted((p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    export = run_dir / "export"
    export.mkdir(exist_ok=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copy2(checkpoints[-1] / file, export / file)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [m["val"] for m in metrics if "val" in m]
    resolved = run_dir / "checkpoints" / "run.yaml"
    return {
        "steps_logged": sum("train" in m for m in metrics),
        "own_eval": val[-1] if val else None,
        "own_eval_definition": "speculators' own validation (its --train-data-ratio split = our eval split), last "
                               "epoch: full_acc_k = steps 0..k all correct (teacher forced), cond_acc_k = step k "
                               "correct given 0..k-1 correct; its step alignment ignores document boundaries",
        "resolved_config": resolved.read_text() if resolved.exists() else None,
        "checkpoint": str(checkpoints[-1]), "export": str(export),
    }


# ------------------------------------------------------------------------------------------ CPU launch
class _JsonLines(logging.Handler):
    """Appends each `speculators.metrics` record (a dict) as one JSON line."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict):
            with open(self.path, "a") as f:
                f.write(json.dumps(record.msg, default=float) + "\n")


def patch_for_cpu(metrics_path: Path) -> None:
    import speculators.train.cli as cli
    import speculators.train.trainer as trainer

    if torch.accelerator.current_accelerator() is None:
        trainer.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *args, **kwargs: None
        original_init = trainer.Trainer.__init__

        def init_on_cpu(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            self.device_type = "cpu"

        trainer.Trainer.__init__ = init_on_cpu

    original_setup = cli.setup_metric_logger

    def setup_and_record(*args, **kwargs):
        original_setup(*args, **kwargs)
        logging.getLogger("speculators.metrics").addHandler(_JsonLines(metrics_path))

    cli.setup_metric_logger = setup_and_record


def train_lm_head() -> None:
    """Ablation only (`--bench-train-lm-head`): speculators freezes the draft lm_head (the verifier's rows);
    make it trainable, as ours is. Its Muon split sends lm_head to the AdamW group by name."""
    import speculators.train.trainer as trainer

    original_init = trainer.Trainer.__init__

    def init_with_head(self, model, *args, **kwargs):
        model.lm_head.weight.requires_grad_(True)
        original_init(self, model, *args, **kwargs)

    trainer.Trainer.__init__ = init_with_head


def main(argv: list[str]) -> None:
    from speculators.train.cli import main as speculators_train
    from speculators.train.config import TrainConfig

    if "--bench-train-lm-head" in argv:
        argv = [a for a in argv if a != "--bench-train-lm-head"]
        train_lm_head()
    cfg = TrainConfig.resolve(argv)
    save_path = Path(cfg.flatten()["save_path"])
    save_path.parent.mkdir(parents=True, exist_ok=True)
    metrics = save_path.parent / "metrics.jsonl"
    metrics.unlink(missing_ok=True)
    patch_for_cpu(metrics)
    speculators_train(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
