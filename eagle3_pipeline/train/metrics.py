"""Training metrics: per TTT step loss and top-1 accuracy, on train and eval; written three ways.

    metrics.jsonl   one JSON record per log or eval point: {"step", "split", "loss_0", "acc_0", ..., "lr", ...},
                    loss_<k> the forward KL whatever `train.loss`; with train.loss tv, lk or lk_alpha also that
                    loss as <train.loss>_<k> (`tv_0`, ...), the one trained;
                    and per step the packs it trained on: {"step", "split": "batch", "packs": [{"position",
                    "epoch", "samples"}, ...]}
    tensorboard/    the same scalars (`tensorboard --logdir <run_dir>/04_train/tensorboard`)
    curves.png      loss and accuracy per TTT step against the optimizer step, and the simulated acceptance
                    length per k (eval records' `al_k<k>`, acceptance.py), drawn at the end

Accuracy at step k: the draft's top-1 equals the verifier's top-1 (both over the draft vocab) at the rows
counted at step k, with the true tokens before it (teacher forcing): the chance that the draft's (k+1)-th
token is accepted given that the ones before it were.

A resumed run first drops records past its checkpoint, so the files read as one uninterrupted run.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from eagle3_pipeline.acceptance import is_metric_key, metric_key, overall_ks
from eagle3_pipeline.stage_io import atomic_path, save_figure_atomic
from eagle3_pipeline.train.draft_model import STATS


def trained_loss_key(loss: str, step: int) -> str:
    """The record key of the mean `train.loss` at TTT step `step`."""
    return f"loss_{step}" if loss == "kl" else f"{loss}_{step}"


def summarize(stats: torch.Tensor, loss: str = "kl") -> dict[str, float]:
    """Per TTT step mean KL, accuracy and (`loss`, `train.loss`, not kl) mean loss from summed statistics
    [len(STATS), ttt_steps]."""
    kl_sum, correct, count, loss_sum = (stats[STATS.index(name)].double().cpu() for name in STATS)
    count = count.clamp(min=1)
    values = {}
    for step in range(stats.shape[1]):
        values[f"loss_{step}"] = float(kl_sum[step] / count[step])
        values[f"acc_{step}"] = float(correct[step] / count[step])
        if loss != "kl":
            values[trained_loss_key(loss, step)] = float(loss_sum[step] / count[step])
    return values


def eval_summary(values: dict | None) -> dict:
    """An eval point's figures as 04's manifest and 05's model card record them, rounded: accuracy and loss per
    TTT step, and the simulated acceptance (acceptance.py's keys; None when the eval answers are not greedy
    ones, so nothing was simulated). Each None without an eval."""
    if not values:
        return dict.fromkeys(("eval_accuracy", "eval_loss", "simulated_acceptance"))
    steps = range(sum(1 for key in values if key.startswith("acc_")))
    simulated = {key: round(value, 6) for key, value in values.items() if is_metric_key(key)}
    return {"eval_accuracy": [round(values[f"acc_{k}"], 6) for k in steps],
            "eval_loss": [round(values[f"loss_{k}"], 6) for k in steps], "simulated_acceptance": simulated or None}


class MetricsLog:
    """Writes metrics on the main process; the other processes hold a disabled log."""

    def __init__(self, folder: Path, resume_step: int, enabled: bool):
        self.path = folder / "metrics.jsonl"
        self.enabled = enabled
        self.writer = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.records = [r for r in self._read() if r["step"] <= resume_step]
        with atomic_path(self.path) as tmp:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        # purge_step hides TensorBoard events a killed run wrote past the checkpoint we resume from
        self.writer = SummaryWriter(str(folder / "tensorboard"), purge_step=resume_step + 1)

    def _read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def _append(self, record: dict) -> None:
        if record["split"] != "batch":  # plotted or read back; batch records are only written
            self.records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def log(self, step: int, split: str, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._append({"step": step, "split": split, **values})
        for name, value in values.items():
            self.writer.add_scalar(f"{split}/{name}", value, step)

    def log_batch(self, step: int, packs: list[dict]) -> None:
        """What step `step` trained on (metrics.jsonl only: these are not scalars)."""
        if self.enabled:
            self._append({"step": step, "split": "batch", "packs": packs})

    def plot(self, path: Path, ttt_steps: int) -> None:
        """curves.png: loss and accuracy per TTT step, train lines and eval points."""
        if not self.enabled:
            return
        import matplotlib

        matplotlib.use("Agg")  # no display on training nodes
        import matplotlib.pyplot as plt

        ks = overall_ks({key for r in self.records if r["split"] == "eval" for key in r})
        simulated = [metric_key(k) for k in ks]
        fig, axes = plt.subplots(1, 3 if simulated else 2, figsize=(18 if simulated else 12, 4.5))
        for key in simulated:  # acceptance.py: what vLLM would measure, from the eval forward
            axes[2].plot(*zip(*[(r["step"], r[key]) for r in self.records if key in r]), "o-",
                         label=f"simulated, {key.removeprefix('al_')}")
        if simulated:
            axes[2].set_xlabel("optimizer step")
            axes[2].set_ylabel("mean acceptance length (greedy chain)")
            axes[2].grid(alpha=0.3)
            axes[2].legend(fontsize=8)
        for ax, metric in zip(axes, ("loss", "acc")):
            for k in range(ttt_steps):
                color = f"C{k}"
                for split, style in (("train", "-"), ("eval", "o--")):
                    points = [(r["step"], r[f"{metric}_{k}"]) for r in self.records if r["split"] == split]
                    if points:
                        ax.plot(*zip(*points), style, color=color, label=f"{split} step {k}", alpha=0.9)
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("forward KL to the verifier" if metric == "loss" else "top-1 accuracy")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        save_figure_atomic(fig, path)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
