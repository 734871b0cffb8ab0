"""Training choices measured by the acceptance they buy: 04 retrained per variant on one finished run's data.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/train_levers.py --run-dir runs/demo --config configs/demo.yaml \
        --variants baseline ttt5_decay --seeds 0

For each variant (a list of `--set` overrides, VARIANTS below) and seed, 04_train.py runs in its own folder
under --out whose 01_data, 02_hidden_states and 03_vocab are links to --run-dir's (same data, same states,
same vocabulary, same shape, same number of optimizer steps and training tokens: only the named choices
move). What it reads back is 04's own eval: the simulated vLLM acceptance length per k and eval source
(eagle3_pipeline/train/acceptance.py, within 3% of vLLM's on the demo: tests/validate/test_vllm_validate.py)
and the teacher-forced accuracy per TTT step. Finished variants are kept and not retrained. Writes
bench/results/train_levers.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
SHARED = ("01_data", "02_hidden_states", "03_vocab")
DECAY = [round(0.8 ** k, 4) for k in range(7)]  # the EAGLE-3 reference code's step weights
RAW_AUX = "train.standardize_aux=false"  # fc on the raw aux states (the configs' choice before standardize_aux)
SPECULATORS_NORMS = ["draft.norm_before_fc=true", "draft.norm_output=true", "draft.norm_before_residual=true", RAW_AUX]
VARIANTS: dict[str, list[str]] = {
    "baseline": [],  # the config's own choices
    "raw_aux": [RAW_AUX],
    "standardize_aux": ["train.standardize_aux=true"],
    "ttt5_decay": ["train.ttt_steps=5", f"train.ttt_step_weights={DECAY[:5]}"],
    "ttt7_decay": ["train.ttt_steps=7", f"train.ttt_step_weights={DECAY}"],
    "ttt3_decay": [f"train.ttt_step_weights={DECAY[:3]}"],
    "lr_2e-3": ["train.learning_rate=2.0e-3"],
    "lr_5e-4": ["train.learning_rate=5.0e-4"],
    "standardize_aux+lr_2e-3": ["train.standardize_aux=true", "train.learning_rate=2.0e-3"],
    "standardize_aux+min_lr_0": ["train.standardize_aux=true", "train.min_lr_ratio=0.0"],
    "muon": ["train.optimizer=muon", RAW_AUX],  # speculators' optimizer
    "muon+standardize_aux": ["train.optimizer=muon", "train.standardize_aux=true"],
    "frozen_lm_head": ["train.freeze_lm_head=true", RAW_AUX],  # speculators freezes it
    # speculators' layout (its three norm flags, read by vLLM from config.json): not the reference's semantics
    "specnorms": SPECULATORS_NORMS,
    "specnorms+muon": [*SPECULATORS_NORMS, "train.optimizer=muon"],
}


def train(args, name: str, seed: int) -> dict:
    folder = args.out / f"{name}-seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    for stage in SHARED:
        link = folder / stage
        if not link.exists():
            link.symlink_to((args.run_dir / stage).resolve(), target_is_directory=True)
    manifest = folder / "04_train" / "manifest.json"
    seconds = None
    if not manifest.exists():
        overrides = [f"run_dir={folder}", f"train.seed={seed}", *args.set, *VARIANTS[name]]
        command = [sys.executable, "04_train.py", "--config", str(args.config)]
        for override in overrides:
            command += ["--set", override]
        started = time.perf_counter()
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        seconds = round(time.perf_counter() - started, 1)
        if result.returncode != 0:
            raise SystemExit(f"{name} seed {seed}: 04_train.py exited {result.returncode}:\n{result.stderr[-3000:]}")
    counts = json.loads(manifest.read_text())["counts"]
    print(f"{name} seed {seed}: {counts['simulated_acceptance']}", flush=True)
    return {"variant": name, "seed": seed, "overrides": VARIANTS[name], "train_wall_s": seconds,
            "eval_accuracy": counts["eval_accuracy"], "simulated_acceptance": counts["simulated_acceptance"]}


def render(results: list[dict], command: str) -> str:
    keys = sorted({key for r in results for key in r["simulated_acceptance"] if "_pos" not in key},
                  key=lambda key: ("/" in key, key))
    lines = ["# Training choices, by 04's simulated acceptance length", "", f"Command: `{command}`", "",
             "Mean [min, max] over seeds; `al_k3` = all eval turns at k=3, `al_k3/<source>` per eval source.", "",
             "| variant | seeds | " + " | ".join(keys) + " | acc_0 | acc_1 | acc_2 |",
             "|---|---|" + "---|" * (len(keys) + 3)]
    for name in dict.fromkeys(r["variant"] for r in results):
        rows = [r for r in results if r["variant"] == name]
        cells = [spread([r["simulated_acceptance"][key] for r in rows]) for key in keys]
        cells += [spread([r["eval_accuracy"][k] for r in rows]) for k in range(3)]
        lines.append(f"| {name} | {','.join(str(r['seed']) for r in rows)} | " + " | ".join(cells) + " |")
    lines += ["", "Overrides: " + "; ".join(f"{name}: `{' '.join(VARIANTS[name]) or 'none'}`"
                                         for name in dict.fromkeys(r["variant"] for r in results))]
    return "\n".join(lines) + "\n"


def spread(values: list[float]) -> str:
    mean = statistics.fmean(values)
    return f"{mean:.3f}" if len(values) == 1 else f"{mean:.3f} [{min(values):.3f}, {max(values):.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", type=Path, required=True, help="a run with finished 01, 02 and 03")
    parser.add_argument("--config", type=Path, required=True, help="the config that run was made with")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--set", nargs="*", default=[], help="overrides for every variant (e.g. train.max_steps=128)")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "train_levers")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "train_levers")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    results = [train(args, name, seed) for name in args.variants for seed in args.seeds]
    command = "HF_HUB_OFFLINE=1 .venv/bin/python bench/train_levers.py " + " ".join(sys.argv[1:])
    args.results.with_suffix(".json").write_text(json.dumps({"command": command, "results": results}, indent=2))
    args.results.with_suffix(".md").write_text(render(results, command))
    print(render(results, command))


if __name__ == "__main__":
    main()
