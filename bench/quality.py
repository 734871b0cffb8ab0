"""Quality benchmark: acceptance length of our draft (04_train.py) against speculators 0.9.0's own trainer.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/quality.py                  # the whole bench, one command

From one shared run of stages 01-03 on the demo target (SmolLM2-135M-Instruct, configs/demo.yaml), for each
seed it trains the 2 x 2 of trainer x layout, drafts of the same shape (hidden 576, 9 heads x 64, 3 KV heads,
MLP 1536, draft vocab 4096, aux layers [2, 15, 27]) on the same data and the same number of training tokens:

    ours                  04_train.py (train.seed = seed), the config's training choices, exported by
                          05_export.py; vLLM serves 05_export/reference/ (the reference layout: every norm flag
                          off, what configs/kimi_k25.yaml exports)
    ours+specnorms        the same with speculators' three norm flags (norm_before_fc, norm_output,
                          norm_before_residual: speculators' layout; vLLM reads them from config.json)
    speculators           `speculators train` (bench/speculators_trainer.py: its CLI entry, CPU workarounds applied
                          from the outside) on our 01 token ids / loss masks, our 02 hidden states and our 03
                          d2t/t2d, its defaults except: the batch shape (--total-seq-len = our packed_length, so
                          both take the same optimizer steps), the token budget (--max-steps/--epochs from its own
                          sampler's batches), the CPU-forced flags (sdpa attention, eager loss, no loader workers)
                          and float32 (our CPU precision); vLLM serves its final checkpoint directly
    speculators+refnorms  the same with its three norm flags off: the reference layout

then measures every draft with 06's vLLM acceptance run (`eagle3_pipeline.validate.acceptance.serve`, one engine
per k) on the same held-out eval prompts (06's: every served turn of the eval split, MT-Bench and HumanEval
counted apart), at each k of --ks, and with one shared teacher-forced evaluator on our eval split
(bench/draft_eval.py: step-0..2 accuracy, chained accuracy, KL, and the acceptance length 04's eval simulates,
per eval source, beside vLLM's). Every figure is the mean over the seeds, with min/max/std. Writes
bench/results/quality.json, quality.md and quality.png.

Work is kept under --run-dir (default runs/bench_quality): a rerun skips what is complete (stages no-op, runs
cached in bench_*.json files); --force-train retrains and remeasures. Options:

    --seeds 0 1 2  --ks 3 5  --max-prompts all  --max-tokens 48  --config configs/demo.yaml
    --max-steps 128                  the training budget: our optimizer steps of one 1024-row pack (speculators
                                     gets the same tokens); 'config' = the config's train.max_steps
    --reuse-01 runs/demo/01_data     copy a finished 01_data of the same config instead of generating it
    --variants NAME ... [--variant-seeds 0 --variant-ks 3]   ablations (see ABLATIONS), measured like the four
    --train-only                     stop after the trainings (e.g. to train ablations while engines run)

The work folder is runs/bench_quality/<hash of the sections stages 01-03 read>/ (config.yaml inside): a config
edited there gets a fresh one. Each draft's folder in it, <name>_seed<seed>_<hash>, is named by what that draft
depends on besides (ours: its draft/train/export sections; speculators': the token budget, batch shape, flags),
so an edited train: section retrains our drafts and keeps the stages and speculators' drafts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from eagle3_pipeline.acceptance import metric_key  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
PY = sys.executable
# speculators' three norm flags for our trainer (norm_before_fc normalises what train.standardize_aux would scale)
SPECULATORS_NORMS = ["draft.norm_before_fc=true", "draft.norm_output=true", "draft.norm_before_residual=true",
                     "train.standardize_aux=false"]
REFERENCE_NORMS = ["--no-norm-before-fc", "--no-norm-output", "--no-norm-before-residual"]
# The 2 x 2: name -> (trainer, layout, extra config overrides (ours) or extra `speculators train` flags)
DRAFTS: dict[str, tuple[str, str, list[str]]] = {
    "ours": ("ours", "reference", []),
    "ours+specnorms": ("ours", "speculators", SPECULATORS_NORMS),
    "speculators": ("speculators", "speculators", []),
    "speculators+refnorms": ("speculators", "reference", REFERENCE_NORMS),
}
MAIN = tuple(DRAFTS)
SHARED_SECTIONS = ("target", "data", "capture", "vocab", "draft")  # what stages 01-03 and the shape depend on
DRAFT_SECTIONS = ("draft", "train", "export")  # what one of our drafts depends on beyond them
SHARED_STAGES = ("01_prepare_data.py", "02_generate_hidden_states.py", "03_build_vocab_map.py")
# Ablations (measured like the four, to back or explain a choice, never to tune the bench): one draft with one
# setting moved. (trainer, extra config overrides or extra `speculators train` flags)
ABLATIONS: dict[str, tuple[str, list[str]]] = {
    "speculators+adamw": ("speculators", ["--optimizer", "adamw"]),  # its Muon -> AdamW (its lr, wd, schedule)
    "speculators+lmhead": ("speculators", ["--bench-train-lm-head"]),  # its frozen lm_head trained, as ours
    "ours+normres": ("ours", ["draft.norm_before_residual=true"]),  # speculators' norm_before_residual default
    # our training choice taken back (configs/demo.yaml's train.standardize_aux)
    "ours-standardize": ("ours", ["train.standardize_aux=false"]),
}


# ------------------------------------------------------------------------------------------------ helpers
class Clock:
    def __init__(self):
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.load_averages: list[float] = []  # 1-minute load average at the end of each phase

    def phase(self, name: str, seconds: float) -> None:
        self.phases[name] = round(self.phases.get(name, 0.0) + seconds, 1)
        self.load_averages.append(round(os.getloadavg()[0], 2))  # wall times only compare on a quiet machine
        print(f"[bench {time.perf_counter() - self.start:7.0f} s] {name}: {seconds:.0f} s", flush=True)

    def say(self, text: str) -> None:
        print(f"[bench {time.perf_counter() - self.start:7.0f} s] {text}", flush=True)


LAST_CPU_S: list[float] = [0.0]  # CPU seconds (user + sys) of the last run_logged command and its children


def run_logged(cmd: list[str], log: Path) -> float:
    """Run a command with its output in `log`; wall seconds (its CPU seconds in LAST_CPU_S). Raises with the
    log's tail on failure."""
    import resource

    log.parent.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        code = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=os.environ.copy())
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    LAST_CPU_S[0] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1)
    if code:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{' '.join(cmd[:2])} failed ({code}); {log}:\n{tail}")
    return seconds


def stage_cmd(script: str, config: Path, overrides: list[str], *extra: str) -> list[str]:
    cmd = [PY, script, "--config", str(config)]
    for override in overrides:
        cmd += ["--set", override]
    return cmd + list(extra)


def cached(path: Path, force: bool = False):
    return None if force or not path.exists() else json.loads(path.read_text())


def save(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "per_seed": values}


def link_shared(run_dir: Path, shared: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in ("01_data", "02_hidden_states", "03_vocab"):
        link = run_dir / name
        if not link.exists():
            link.symlink_to(os.path.relpath(shared / name, run_dir))


# ----------------------------------------------------------------------------------------- token budgets
def our_token_budget(config) -> int:
    """Rows (tokens after the one-token shift) our 04 trains on: its own pack stream, max_steps global batches."""
    from eagle3_pipeline.data.dataset import open_split
    from eagle3_pipeline.pack_plan import run_pack_stream

    train = config.train
    split = open_split(Path(config.run_dir) / "01_data", "train")
    stream = run_pack_stream(config, split["seq_len"])
    packs = train.max_steps * train.micro_batch_size * train.grad_accumulation  # one process
    return int(sum(stream.rows_per_sample[list(stream.pack(p))].sum() for p in range(packs)))


def matched_steps(batch_rows: list[int], budget: int) -> tuple[int, int]:
    """(max_steps, tokens) of speculators' batch sequence closest to `budget` tokens."""
    best, total = (1, batch_rows[0]), 0
    for step, rows in enumerate(batch_rows, 1):
        total += rows
        if abs(total - budget) < abs(best[1] - budget):
            best = (step, total)
        if total > budget:
            break
    return best


# ------------------------------------------------------------------------------------------------ phases
def shared_stages(args, clock: Clock, shared: Path) -> dict[str, float]:
    """Stages 01-03 once for every draft; seconds per stage (from its manifest when it was already complete)."""
    overrides = [f"run_dir={shared}"]
    if args.reuse_01 and not (shared / "01_data" / "manifest.json").exists():
        shutil.copytree(args.reuse_01, shared / "01_data", symlinks=True)
        clock.say(f"01_data copied from {args.reuse_01}")
    stage_seconds = {}
    for script in SHARED_STAGES:
        seconds = run_logged(stage_cmd(script, args.config, overrides), shared / "logs" / f"{script[:2]}.log")
        clock.phase(f"stage {script}", seconds)
        stage_dir = next(shared.glob(f"{script[:2]}_*/manifest.json"))
        stage_seconds[script] = max(seconds, json.loads(stage_dir.read_text())["timings_s"]["total"])
    return stage_seconds


def train_ours(args, clock: Clock, shared: Path, name: str, seed: int, extra: list[str]) -> dict:
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.stage_io import fingerprint

    overrides = [f"train.seed={seed}", *args.budget, *extra]
    resolved = load_config(args.config, overrides)  # an edited train: section gets a fresh folder
    run_dir = args.run_dir / f"{name}_seed{seed}_{fingerprint({s: resolved.section(s) for s in DRAFT_SECTIONS})[:6]}"
    overrides.insert(0, f"run_dir={run_dir}")
    record = cached(run_dir / "bench_train.json", args.force_train)
    if record is None:
        link_shared(run_dir, shared)
        force = ["--force"] if args.force_train else []
        seconds = run_logged(stage_cmd("04_train.py", args.config, overrides, *force), run_dir / "logs" / "04.log")
        cpu_s = LAST_CPU_S[0]
        run_logged(stage_cmd("05_export.py", args.config, overrides, "--force"), run_dir / "logs" / "05.log")
        manifest = json.loads((run_dir / "04_train" / "manifest.json").read_text())
        config = load_config(args.config, overrides)
        eval_records = [json.loads(line) for line in (run_dir / "04_train" / "metrics.jsonl").read_text().splitlines()
                        if '"eval"' in line]
        record = {
            "trainer": name, "seed": seed, "run_dir": str(run_dir), "overrides": overrides, "train_wall_s": round(seconds, 1),
            "train_cpu_s": cpu_s,
            "train_tokens": manifest["counts"]["train_tokens_this_launch"],
            "train_tokens_planned": our_token_budget(config), "optimizer_steps": config.train.max_steps,
            "own_eval": {k: v for k, v in eval_records[-1].items() if k.startswith(("acc_", "loss_"))},
            "own_eval_definition": "04 metrics.jsonl, last eval record: teacher-forced top-1 agreement per TTT step",
            # 04's own simulated acceptance (fp32 checkpoint): the shared evaluator's, on the bf16 export, beside it
            "simulated_by_04": manifest["counts"].get("simulated_acceptance"),
            "export": str(run_dir / "05_export" / "reference"),
            "export_speculators": str(run_dir / "05_export" / "speculators"),
        }
        save(run_dir / "bench_train.json", record)
    clock.phase(f"train {name} seed {seed}", record["train_wall_s"])
    return record


def device_flags() -> list[str]:
    """The `speculators train` flags its defaults need on this machine."""
    import torch

    if torch.cuda.is_available():
        # its fused loss is a Triton kernel that fails under torch 2.11 (bench/train_throughput.py); the loader's
        # processes are capped so that several trainings share the node's cores
        return ["--loss-implementation", "eager", "--num-workers", "4"]
    # CPU: flex attention has no CPU backward, the fused loss is a Triton kernel, 2 cores, fp32 as ours
    return ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--num-workers", "0",
            "--hidden-states-dtype", "float32"]


def train_speculators(args, clock: Clock, shared: Path, seed: int, budget: int, config, name: str = "speculators",
                      extra: list[str] = ()) -> dict:
    from bench.speculators_trainer import train_batches, write_dataset
    from eagle3_pipeline.stage_io import fingerprint

    data_dir = args.run_dir / "speculators_data"
    facts = write_dataset(shared, data_dir)
    inputs = {"budget": budget, "packed_length": config.train.packed_length, "extra": list(extra)}
    run_dir = args.run_dir / f"{name}_seed{seed}_{fingerprint(inputs)[:6]}"
    record = cached(run_dir / "bench_train.json", args.force_train)
    if record is not None:
        clock.phase(f"train {name} seed {seed}", record["train_wall_s"])
        return record
    if run_dir.exists():
        shutil.rmtree(run_dir)  # its trainer resumes from checkpoints it finds: start clean
    total_seq_len = config.train.packed_length
    batches = train_batches(data_dir, total_seq_len, facts["train_data_ratio"], seed, epochs=50)
    max_steps, tokens = matched_steps(batches, budget)
    per_epoch = len(train_batches(data_dir, total_seq_len, facts["train_data_ratio"], seed, epochs=1))
    epochs = -(-max_steps // per_epoch)  # its loop runs whole epochs; max_steps cuts the last one
    from eagle3_pipeline.target import target_path

    verifier = target_path(config.target)
    cmd = [
        PY, "bench/speculators_trainer.py",
        "--verifier-name-or-path", str(verifier),
        "--data-path", str(data_dir),
        "--save-path", str(run_dir / "checkpoints"),
        "--log-dir", str(run_dir / "logs"),
        "--seed", str(seed),
        # same shape: its defaults already synthesise 576 / 9 x 64 / 3 KV / 1536 from the verifier; the vocab:
        "--draft-vocab-size", str(config.draft.draft_vocab_size),
        "--d2t-path", str(shared / "03_vocab" / "d2t.npy"),
        "--t2d-path", str(shared / "03_vocab" / "t2d.npy"),
        "--target-layer-ids", *[str(i) for i in facts["aux_layer_ids"]],
        # same data, same budget, same batch
        "--train-data-ratio", repr(facts["train_data_ratio"]),
        "--total-seq-len", str(total_seq_len),
        "--max-steps", str(max_steps),
        "--epochs", str(epochs),
        "--on-missing", "raise",
        *device_flags(),
        *extra,
    ]
    seconds = run_logged(cmd, run_dir / "train.log")
    checkpoints = sorted((p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    export = run_dir / "export"
    export.mkdir(exist_ok=True)
    for file in ("config.json", "model.safetensors"):
        shutil.copy2(checkpoints[-1] / file, export / file)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    val = [m["val"] for m in metrics if "val" in m]
    train_steps = [m for m in metrics if "train" in m]
    resolved = (run_dir / "checkpoints" / "run.yaml")
    record = {
        "trainer": name, "seed": seed, "run_dir": str(run_dir), "command": cmd, "train_wall_s": round(seconds, 1),
        "train_cpu_s": LAST_CPU_S[0],
        "train_tokens": tokens, "optimizer_steps": max_steps, "epochs": epochs,
        "steps_logged": len(train_steps), "batches_per_epoch": per_epoch,
        "own_eval": val[-1] if val else None,
        "own_eval_definition": "speculators' own validation (its --train-data-ratio split = our eval split), last "
                               "epoch: full_acc_k = steps 0..k all correct (teacher forced), cond_acc_k = step k "
                               "correct given 0..k-1 correct; its step alignment ignores document boundaries",
        "resolved_config": resolved.read_text() if resolved.exists() else None,
        "checkpoint": str(checkpoints[-1]), "export": str(export), "export_speculators": str(export),
    }
    save(run_dir / "bench_train.json", record)
    clock.phase(f"train {name} seed {seed}", seconds)
    return record


def evaluated(record: dict, rows, config, ks: list[int], force: bool = False, device: str = "cpu") -> dict:
    """One draft's figures from the shared evaluator (bench/draft_eval.py) on `rows`, cached in its folder."""
    from bench.draft_eval import evaluate

    path = Path(record["run_dir"]) / f"bench_shared_eval_k{'_'.join(map(str, ks))}.json"
    values = cached(path, force)
    if values is None:
        values = evaluate(Path(record["export_speculators"]), rows, config.train.ttt_steps, ks,
                          config.validate_.max_tokens, device)
        save(path, values)
    return values


def shared_eval(args, clock: Clock, shared: Path, records: list[dict], config) -> None:
    from bench.draft_eval import EvalRows

    started = time.perf_counter()
    rows = EvalRows(shared, config.train.packed_length)  # packed when the first uncached draft reads them
    for record in records:
        record["shared_eval"] = evaluated(record, rows, config, args.ks, args.force_train)
    clock.phase("shared teacher-forced eval", time.perf_counter() - started)


def measure(args, clock: Clock, record: dict, k: int, config, prompts: list) -> dict:
    from eagle3_pipeline.target import target_path
    from eagle3_pipeline.validate.acceptance import serve

    path = Path(record["run_dir"]) / f"bench_serve_k{k}_{len(prompts)}x{config.validate_.max_tokens}.json"
    result = cached(path, args.force_train)
    if result is None:
        started = time.perf_counter()
        run = serve(config, target_path(config.target), prompts, Path(record["export"]), k)
        result = {
            "k": k, "mean_acceptance_length": run.mean_acceptance_length,
            "mean_request_acceptance_length": run.mean_request_acceptance_length,
            "acceptance_per_position": run.acceptance_per_position, "counters": run.counts.vllm_counters(),
            "generate_s": round(run.batch.seconds, 1), "engine_wall_s": round(time.perf_counter() - started, 1),
            "generated_tokens": run.generated_tokens, "skipped_parameters": run.skipped_parameters,
            "by_source": {source: {"mean_acceptance_length": counts.mean_acceptance_length,
                                   "mean_request_acceptance_length": counts.mean_request_acceptance_length,
                                   "acceptance_per_position": counts.acceptance_per_position,
                                   "num_drafts": counts.counts.drafts, "prompts": len(counts.requests)}
                          for source, counts in run.by_source.items()},
            "outputs": run.outputs,
        }
        save(path, result)
    clock.phase(f"vLLM k={k} {record['trainer']} seed {record['seed']}: mean acceptance length "
                f"{result['mean_acceptance_length']:.3f}", result["engine_wall_s"])
    return result


# ------------------------------------------------------------------------------------------------ report
def summarize(records: list[dict], ks: list[int], ttt_steps: int) -> dict:
    trainers = list(dict.fromkeys(r["trainer"] for r in records))
    out = {}
    for trainer in trainers:
        mine = [r for r in records if r["trainer"] == trainer]
        entry = {
            "trainer": mine[0]["trainer_kind"], "layout": mine[0]["layout"],
            "seeds": [r["seed"] for r in mine],
            "train_wall_s": spread([r["train_wall_s"] for r in mine]),
            "train_tokens": spread([r["train_tokens"] for r in mine]),
            "optimizer_steps": spread([r["optimizer_steps"] for r in mine]),
            "shared_eval": {key: spread([r["shared_eval"][key] for r in mine]) for key in mine[0]["shared_eval"]},
            "own_eval": [r["own_eval"] for r in mine],
            "own_eval_definition": mine[0]["own_eval_definition"],
            "k": {},
        }
        for k in [k for k in ks if all(str(k) in r["serve"] for r in mine)]:
            runs = [r["serve"][str(k)] for r in mine]
            mal = [run["mean_acceptance_length"] for run in runs]
            positions = [[run["acceptance_per_position"][i] for run in runs] for i in range(k)]
            entry["k"][str(k)] = {
                "mean_acceptance_length": statistics.fmean(mal),
                "mean_acceptance_length_spread": spread(mal),
                "acceptance_per_position": [statistics.fmean(p) for p in positions],
                "acceptance_per_position_min": [min(p) for p in positions],
                "acceptance_per_position_max": [max(p) for p in positions],
                "num_drafts": [run["counters"]["num_drafts"] for run in runs],
                "skipped_parameters": sorted({p for run in runs for p in run["skipped_parameters"]}),
                "simulated_mean_acceptance_length": spread([r["shared_eval"][metric_key(k)] for r in mine]),
                "by_source": {source: {
                    "mean_acceptance_length": spread([run["by_source"][source]["mean_acceptance_length"]
                                                      for run in runs]),
                    "simulated_mean_acceptance_length": spread([r["shared_eval"][metric_key(k, source=source)] for r in mine]),
                    "acceptance_per_position": [statistics.fmean(run["by_source"][source]["acceptance_per_position"][i]
                                                                 for run in runs) for i in range(k)],
                    "prompts": runs[0]["by_source"][source]["prompts"],
                } for source in runs[0]["by_source"]},
            }
        out[trainer] = entry
    return out


def work_seconds(stage_seconds: dict, records: list[dict], eval_s: float) -> dict:
    """What the main comparison costs from scratch (sum of its phases, cached ones included) and the ablations."""
    main = [r for r in records if r["trainer"] in MAIN]
    extra = [r for r in records if r["trainer"] not in MAIN]
    cost = lambda rs: sum(r["train_wall_s"] + sum(run["engine_wall_s"] for run in r["serve"].values()) for r in rs)  # noqa: E731
    return {"stages_01_03": {k: round(v, 1) for k, v in stage_seconds.items()},
            "main_comparison_total": round(sum(stage_seconds.values()) + cost(main) + eval_s, 1),
            "ablations_total": round(cost(extra), 1)}


def identical_outputs(records: list[dict], ks: list[int]) -> dict:
    """Greedy outputs with either draft should be the target's own: share of prompts identical to the first run."""
    first = records[0]["serve"][str(ks[0])]["outputs"]
    shares = {}
    for r in records:
        for k in [k for k in ks if str(k) in r["serve"]]:
            outputs = r["serve"][str(k)]["outputs"]
            shares[f"{r['trainer']}_seed{r['seed']}_k{k}"] = sum(a == b for a, b in zip(first, outputs)) / len(first)
    return shares


def comparison_lines(report: dict) -> list[str]:
    """The two targets (ours in the reference layout >= speculators' defaults; ours in speculators' layout >= 5%
    ahead of them), per k and eval source, then each ablation against its base draft."""
    res, ks = report["results"], report["ks"]
    if not all(t in res for t in MAIN):
        return []
    spec = res["speculators"]
    out = []
    for name, needed in (("ours", 1.0), ("ours+specnorms", 1.05)):
        for k in ks:
            for scope, pick in [("all prompts", lambda e: e["k"][str(k)]["mean_acceptance_length_spread"])] + [
                    (source, lambda e, source=source: e["k"][str(k)]["by_source"][source]["mean_acceptance_length"])
                    for source in spec["k"][str(k)]["by_source"]]:
                a, b = pick(res[name]), pick(spec)
                ratio = a["mean"] / b["mean"]
                every = all(v > b["mean"] * needed for v in a["per_seed"])
                out.append(f"k={k}, {scope}: {name} ({res[name]['layout']} layout) {a['mean']:.3f} vs speculators "
                           f"{b['mean']:.3f} ({100 * (ratio - 1):+.1f}%; target {100 * (needed - 1):+.0f}%: "
                           f"{'met' if ratio >= needed else 'missed'}; every seed of {name} above "
                           f"{needed:.2f} x speculators' mean: {'yes' if every else 'no'}, worst seed {a['min']:.3f})")
    ours = res["ours"]
    se_o, se_s = ours["shared_eval"], spec["shared_eval"]
    out.append("teacher-forced (shared evaluator), ours vs speculators: " + ", ".join(
        f"acc_{k} {se_o[f'acc_{k}']['mean']:.3f} vs {se_s[f'acc_{k}']['mean']:.3f}" for k in range(report["ttt_steps"])))
    out.append(f"training wall time ours {ours['train_wall_s']['mean']:.0f} s vs speculators "
               f"{spec['train_wall_s']['mean']:.0f} s for {ours['train_tokens']['mean']:.0f} vs "
               f"{spec['train_tokens']['mean']:.0f} tokens ({ours['optimizer_steps']['mean']:.0f} vs "
               f"{spec['optimizer_steps']['mean']:.0f} optimizer steps)")
    for name, (base, _) in ABLATIONS.items():
        if name not in res:
            continue
        e = res[name]
        seeds = e["seeds"]
        base_runs = [r for r in report["runs"] if r["trainer"] == base and r["seed"] in seeds]
        line = f"ablation {name} (seed {','.join(map(str, seeds))}) vs {base} at the same seed(s)"
        for k in ks:
            if str(k) in e["k"]:
                base_mal = statistics.fmean(r["serve"][str(k)]["mean_acceptance_length"] for r in base_runs)
                base_sim = statistics.fmean(r["shared_eval"][metric_key(k)] for r in base_runs)
                line += (f"; k={k} mean acceptance length {e['k'][str(k)]['mean_acceptance_length']:.3f} vs "
                         f"{base_mal:.3f} (simulated {e['k'][str(k)]['simulated_mean_acceptance_length']['mean']:.3f}"
                         f" vs {base_sim:.3f})")
        out.append(line)
    return [f"- {line}" for line in out]


def benchmark_table(report: dict) -> list[str]:
    """Mean acceptance length per eval source and k, vLLM's and the simulated one, per draft of the 2 x 2."""
    res, ks = report["results"], report["ks"]
    fmt = lambda s: f"{s['mean']:.3f} [{s['min']:.3f}, {s['max']:.3f}]"  # noqa: E731
    sources = list(res["ours"]["k"][str(ks[0])]["by_source"])
    prompts = {source: res["ours"]["k"][str(ks[0])]["by_source"][source]["prompts"] for source in sources}
    header = ["trainer", "layout"] + [f"{source} k={k} ({prompts[source]}) | simulated"
                                      for k in ks for source in sources]
    header += [f"all k={k} | simulated" for k in ks]
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---|---|" * (len(ks) * (len(sources) + 1))]
    for name in MAIN:
        e = res[name]
        cells = [e["trainer"], e["layout"]]
        for k in ks:
            for source in sources:
                by = e["k"][str(k)]["by_source"][source]
                cells += [fmt(by["mean_acceptance_length"]), fmt(by["simulated_mean_acceptance_length"])]
        for k in ks:
            cells += [fmt(e["k"][str(k)]["mean_acceptance_length_spread"]),
                      fmt(e["k"][str(k)]["simulated_mean_acceptance_length"])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(report: dict) -> str:
    res, ks = report["results"], report["ks"]
    ttt = report["ttt_steps"]
    fmt = lambda s, d=3: f"{s['mean']:.{d}f} [{s['min']:.{d}f}, {s['max']:.{d}f}]"  # noqa: E731
    lines = [
        "# Draft quality: our trainer vs speculators 0.9.0's `speculators train`, each in both layouts",
        "",
        f"Command: `{report['command']}`  ",
        f"Wall time: {report['work_s']['main_comparison_total'] / 60:.1f} min for the comparison from scratch (sum of "
        f"its phases: stages 01-03, {len(MAIN) * len(report['seeds'])} trainings, "
        f"{len(report['ks']) * len(report['seeds']) * len(MAIN)} vLLM engine runs, "
        f"shared eval; {report['machine']['cpus']} CPU cores, 1-minute load average {report['machine']['load_min']:.1f}"
        f"-{report['machine']['load_max']:.1f} at the ends of its phases); this invocation "
        f"{report['wall_time_s']['total'] / 60:.1f} min (all invocations: " + "; ".join(
            f"`{i['command'].split('python ')[-1]}` {i['wall_s'] / 60:.1f} min" for i in report.get("invocations", [])) + "); target " f"{report['target']}; seeds "
        f"{report['seeds']}; {report['eval_prompts']} held-out eval prompts x {report['max_tokens']} tokens, greedy, "
        "vLLM acceptance counters (06's `serve`). Figures: mean [min, max] over the seeds.",
        "",
        "Mean acceptance length per held-out eval source (served turns in brackets; MT-Bench both turns, the "
        "second after the target's own first answer; HumanEval's first 16 problems, never trained on), vLLM's "
        "counters beside 04's simulation (bench/draft_eval.py replaying greedy chain drafting on the same answers):",
        "",
        *benchmark_table(report),
        "",
        "| trainer | train wall s | train tokens | steps | " + " | ".join(
            f"mean acc. length k={k} | accept. per position k={k}" for k in ks) + " |",
        "|---|---|---|---|" + "---|---|" * len(ks),
    ]
    for trainer, e in res.items():
        if trainer not in MAIN:
            continue
        cells = [trainer, fmt(e["train_wall_s"], 0), f"{e['train_tokens']['mean']:.0f}", f"{e['optimizer_steps']['mean']:.0f}"]
        for k in ks:
            kk = e["k"][str(k)]
            cells.append(fmt(kk["mean_acceptance_length_spread"]))
            cells.append(" / ".join(f"{p:.3f}" for p in kk["acceptance_per_position"]))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Teacher-forced eval on our eval split, one shared evaluator for both (bench/draft_eval.py): "
        "acc_k = step-k top-1 agreement with the verifier; chain_k = steps 0..k all agree.",
        "",
        "| trainer | " + " | ".join(f"acc_{k}" for k in range(ttt)) + " | " + " | ".join(
            f"chain_{k}" for k in range(ttt)) + " | " + " | ".join(f"KL_{k}" for k in range(ttt)) + " |",
        "|---|" + "---|" * (3 * ttt),
    ]
    for trainer, e in res.items():
        if trainer not in MAIN:
            continue
        se = e["shared_eval"]
        cells = [trainer] + [fmt(se[f"acc_{k}"]) for k in range(ttt)] + [fmt(se[f"chain_acc_{k}"]) for k in range(ttt)] \
            + [fmt(se[f"loss_{k}"]) for k in range(ttt)]
        lines.append("| " + " | ".join(cells) + " |")
    ablations = [t for t in res if t not in MAIN]
    if ablations:
        lines += ["", "Ablations (one setting of one trainer moved to the other's choice; same data, budget, shape):", "",
                  "| draft | seeds | train wall s | chain_0 | chain_1 | chain_2 | " + " | ".join(
                      f"mean acc. length k={k}" for k in ks) + " |", "|---|---|---|---|---|---|" + "---|" * len(ks)]
        for trainer in list(MAIN) + ablations:
            e = res[trainer]
            cells = [trainer, ",".join(map(str, e["seeds"])), fmt(e["train_wall_s"], 0)] + [
                fmt(e["shared_eval"][f"chain_acc_{k}"]) for k in range(3)] + [
                fmt(e["k"][str(k)]["mean_acceptance_length_spread"]) if str(k) in e["k"] else "-" for k in ks]
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Each trainer's own eval metric (its definition differs; see quality.json):", ""]
    for trainer, e in res.items():
        if trainer not in MAIN:
            continue
        own = e["own_eval"][0] or {}
        keys = [k for k in own if k.startswith(("acc_", "full_acc_", "cond_acc_"))]
        lines.append(f"- {trainer}: " + ", ".join(
            f"{key} {statistics.fmean([(o or {}).get(key, float('nan')) for o in e['own_eval']]):.3f}" for key in keys))
    lines += ["", "## Measured differences", ""] + comparison_lines(report)
    if report.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, ks = report["results"], report["ks"]
    trainers = [t for t in res if t in MAIN]
    fig, axes = plt.subplots(1, 1 + len(ks), figsize=(5 * (1 + len(ks)), 4.2))
    width = 0.8 / len(trainers)
    ax = axes[0]
    for i, trainer in enumerate(trainers):
        spreads = [res[trainer]["k"][str(k)]["mean_acceptance_length_spread"] for k in ks]
        means = [s["mean"] for s in spreads]
        err = [[m - s["min"] for m, s in zip(means, spreads)], [s["max"] - m for m, s in zip(means, spreads)]]
        x = [j + (i - (len(trainers) - 1) / 2) * width for j in range(len(ks))]
        ax.bar(x, means, width, yerr=err, capsize=4, label=trainer, color=f"C{i}")
        for xi, m in zip(x, means):
            ax.text(xi, m + 0.02, f"{m:.2f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(ks)), [f"k = {k}" for k in ks])
    ax.set_ylabel("mean acceptance length (vLLM)")
    ax.set_title("mean acceptance length, min-max over seeds")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    for ax, k in zip(axes[1:], ks):
        for i, trainer in enumerate(trainers):
            kk = res[trainer]["k"][str(k)]
            means = kk["acceptance_per_position"]
            err = [[m - lo for m, lo in zip(means, kk["acceptance_per_position_min"])],
                   [hi - m for m, hi in zip(means, kk["acceptance_per_position_max"])]]
            x = [j + (i - (len(trainers) - 1) / 2) * width for j in range(k)]
            ax.bar(x, means, width, yerr=err, capsize=3, label=trainer, color=f"C{i}")
        ax.set_xticks(range(k), [str(j + 1) for j in range(k)])
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance rate")
        ax.set_title(f"acceptance per position, k = {k}")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    parser.add_argument("--run-dir", type=Path, default=Path("runs/bench_quality"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--max-steps", default="128", help="optimizer steps of our trainer (1024-row packs; speculators "
                        "gets the same tokens): the bench's training budget, sized for 45 minutes on 2 CPU cores; "
                        "'config' = the config's train.max_steps")
    parser.add_argument("--max-prompts", default="all", help="06's eval prompts served (the first N; all = every "
                        "served turn of the eval split)")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=Path("bench/results/quality.json"))
    parser.add_argument("--reuse-01", type=Path, help="copy this finished 01_data (same config) instead of running 01")
    parser.add_argument("--variants", nargs="*", default=[], choices=sorted(ABLATIONS), help="ablations of ours")
    parser.add_argument("--variant-seeds", type=int, nargs="*", help="seeds the ablations run at (default: --seeds)")
    parser.add_argument("--variant-ks", type=int, nargs="*", help="k values the ablations are served at (default: --ks)")
    parser.add_argument("--train-only", action="store_true", help="stop after the trainings (no eval, vLLM, report)")
    parser.add_argument("--force-train", action="store_true", help="retrain and remeasure everything")
    args = parser.parse_args()
    os.chdir(ROOT)
    if len(args.seeds) < 2:
        print("note: fewer than 2 seeds gives no spread", file=sys.stderr)

    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.stage_io import fingerprint

    clock = Clock()
    # one work folder per content of the sections stages 01-03 read: an edited config never meets stale stage
    # outputs; within it each draft's folder is named by what it depends on (see train_ours, train_speculators)
    args.budget = [] if args.max_steps == "config" else [f"train.max_steps={int(args.max_steps)}"]
    base = load_config(args.config, args.budget)
    args.run_dir = args.run_dir / fingerprint({s: base.section(s) for s in SHARED_SECTIONS})[:10]
    shared = args.run_dir / "shared"
    max_prompts = "null" if args.max_prompts == "all" else int(args.max_prompts)
    config = load_config(args.config, [f"run_dir={shared}", f"validate.max_prompts={max_prompts}",
                                       f"validate.max_tokens={args.max_tokens}", *args.budget])
    if not (args.run_dir / "config.yaml").exists():  # the config this work folder's stages ran with
        import yaml

        dumped = base.model_dump(mode="json", by_alias=True)
        args.run_dir.mkdir(parents=True, exist_ok=True)
        (args.run_dir / "config.yaml").write_text(yaml.safe_dump(dumped, sort_keys=False))
    clock.say(f"shared stages 01-03 in {shared}")
    stage_seconds = shared_stages(args, clock, shared)

    records = []
    for seed in args.seeds:
        budget = None  # the training tokens of ours at this seed: speculators' runs get as many
        drafts = [(name, trainer, layout, extra) for name, (trainer, layout, extra) in DRAFTS.items()]
        drafts += [(name, trainer, DRAFTS[trainer][1], extra) for name, (trainer, extra) in ABLATIONS.items()
                   if name in args.variants and seed in (args.variant_seeds or args.seeds)]
        for name, trainer, layout, extra in drafts:
            if trainer == "ours":
                record = train_ours(args, clock, shared, name, seed, extra)
                budget = budget or record["train_tokens_planned"]
            else:
                record = train_speculators(args, clock, shared, seed, budget, config, name, extra)
            records.append(record | {"trainer_kind": trainer, "layout": layout})
    if args.train_only:
        clock.say("--train-only: trainings done")
        return
    shared_eval(args, clock, shared, records, config)

    from eagle3_pipeline.validate.stage import eval_prompts  # 06's prompts: 01's eval split, first max_prompts

    prompts = eval_prompts(config)
    for record in records:
        ks = args.ks if record["trainer"] in MAIN else (args.variant_ks or args.ks)
        record["serve"] = {str(k): measure(args, clock, record, k, config, prompts) for k in ks}

    results = summarize(records, args.ks, config.train.ttt_steps)
    clock.phases["total"] = round(time.perf_counter() - clock.start, 1)
    report = {
        "command": "HF_HUB_OFFLINE=1 .venv/bin/python bench/quality.py " + " ".join(sys.argv[1:]),
        "target": "SmolLM2-135M-Instruct (stand-in)", "config": str(args.config), "seeds": args.seeds, "ks": args.ks,
        "eval_prompts": len(prompts), "max_tokens": args.max_tokens, "ttt_steps": config.train.ttt_steps,
        "wall_time_s": clock.phases, "run_dir": str(args.run_dir),
        "machine": {"cpus": os.cpu_count(), "load_min": min(clock.load_averages, default=0.0),
                    "load_max": max(clock.load_averages, default=0.0), "load_at_phase_ends": clock.load_averages},
        "work_s": work_seconds(stage_seconds, records, clock.phases.get("shared teacher-forced eval", 0.0)),
        "draft_shape": config.section("draft"),
        "results": results,
        "identical_greedy_outputs": identical_outputs(records, args.ks),
        "runs": [{k: v for k, v in r.items() if k != "serve"} | {"serve": {
            key: {f: x for f, x in run.items() if f != "outputs"} for key, run in r["serve"].items()}} for r in records],
        "notes": NOTES,
    }
    # every invocation that wrote this report, with its wall time (a rerun reuses the cached work of earlier ones)
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    if previous.get("run_dir") != report["run_dir"]:  # another config's report: its invocations are not this one's
        previous = {}
    invocations = previous.get("invocations") or ([{"command": previous["command"], "wall_s": previous["wall_time_s"]["total"]}]
                                                  if "wall_time_s" in previous else [])
    report["invocations"] = invocations + [{"command": report["command"], "wall_s": clock.phases["total"]}]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save(args.out, report)
    args.out.with_suffix(".md").write_text(markdown(report))
    plot(report, args.out.with_suffix(".png"))
    print(markdown(report))
    clock.say(f"wrote {args.out}, {args.out.with_suffix('.md')}, {args.out.with_suffix('.png')}")


NOTES: list[str] = [
    "Layouts: reference = every norm flag off (the AQ-MedAI checkpoint's semantics, what configs/kimi_k25.yaml "
    "exports: fc reads the raw aux states, the residual is taken before hidden_norm, the next step reads the "
    "pre-norm state); speculators = norm_before_fc, norm_output, norm_before_residual on (an input_norm tensor "
    "more; vLLM reads the flags from config.json). ours = configs/demo.yaml's train: section; ours+specnorms the "
    "same with the three flags; speculators+refnorms = speculators' defaults with the three flags off.",
    "Simulated = bench/draft_eval.py replaying greedy chain drafting on the eval split's greedy answers (04's "
    "eval, eagle3_pipeline/train/acceptance.py) for every draft folder vLLM serves, bf16 weights as exported; "
    "quality.json keeps 04's own figure for our drafts (fp32 checkpoint) beside it (`simulated_by_04`).",
    "Same inputs: both trainers read our 01 token ids and loss masks, our 02 hidden states (aux layers "
    "[2, 15, 27], vLLM convention, = speculators' default [2, L//2, L-3]) and our 03 d2t/t2d (our 03 selects "
    "exactly as speculators' build_vocab_mappings_from_distribution: top-4096 loss-masked train tokens, ties to "
    "the lower id), so the output vocabulary is not a variable.",
    "Same budget: speculators' --max-steps is set so that its own sampler's batches sum to the training tokens "
    "ours sees (within one batch), at the same batch shape (one packed row of 1024 = our packed_length).",
    "speculators defaults kept: Muon (2-D weights, lr 1e-3, momentum 0.95, wd 0.1) + AdamW (lr 1e-3, wd 0.01), "
    "linear schedule with 1% warmup, kl_div loss, 3 TTT steps, loss decay 1.0, norm_before_fc, norm_output, "
    "norm_before_residual, frozen lm_head, sliding window 2048 (no effect at <= 1024 tokens), 1 layer, seed as given.",
    "speculators deviations (CPU only): --draft-attn-impl sdpa, --loss-implementation eager (same KL, no Triton), "
    "--num-workers 0, --hidden-states-dtype float32 (our CPU precision; its default bf16 autocast), and three "
    "monkeypatches in bench/speculators_trainer.py (device 'cpu' instead of cuda:0, autocast device, no "
    "accelerator synchronize).",
]


if __name__ == "__main__":
    main()
