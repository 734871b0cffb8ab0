"""Quality benchmark: acceptance length of our draft (04_train.py) against speculators 0.9.0's own trainer.

    HF_HUB_OFFLINE=1 .venv/bin/python -m bench.quality                  # the whole bench, one command

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
cached in bench_*.json files); --force-train retrains and remeasures; --variants adds ablations (ABLATIONS).
The work folder is runs/bench_quality/<hash of the sections stages 01-03 read>/ (config.yaml inside): a config
edited there gets a fresh one. Each draft's folder in it, <name>_seed<seed>_<hash>, is named by what that draft
depends on besides (ours: its draft/train/export sections; speculators': the token budget, batch shape, flags),
so an edited train: section retrains our drafts and keeps the stages and speculators' drafts.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench.harness import LAST_CPU_S, PY, ROOT, Clock, cached, offline, parser, run_logged, save, spread, stage_cmd
from bench.report import render
from eagle3_pipeline.acceptance import metric_key

offline()
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


# ----------------------------------------------------------------------------------------- token budgets
def our_token_budget(config) -> int:
    """Rows (tokens after the one-token shift) our 04 trains on: its own pack stream, max_steps global batches."""
    from eagle3_pipeline.data.dataset import open_split
    from eagle3_pipeline.pack_plan import run_pack_stream

    train = config.train
    stream = run_pack_stream(config, open_split(Path(config.run_dir) / "01_data", "train")["seq_len"])
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
    if args.reuse_01 and not (shared / "01_data" / "manifest.json").exists():
        shutil.copytree(args.reuse_01, shared / "01_data", symlinks=True)
        clock.say(f"01_data copied from {args.reuse_01}")
    stage_seconds = {}
    for script in SHARED_STAGES:
        seconds = run_logged(stage_cmd(script, args.config, [f"run_dir={shared}"]), shared / "logs" / f"{script[:2]}.log")
        clock.phase(f"stage {script}", seconds)
        manifest = next(shared.glob(f"{script[:2]}_*/manifest.json"))
        stage_seconds[script] = max(seconds, json.loads(manifest.read_text())["timings_s"]["total"])
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
        # the shared stages, linked; 03 built here for a draft vocabulary of its own (the full-vocabulary lever)
        own_vocab = resolved.draft.draft_vocab_size != load_config(args.config).draft.draft_vocab_size
        for stage in ("01_data", "02_hidden_states") + (() if own_vocab else ("03_vocab",)):
            (run_dir / stage).parent.mkdir(parents=True, exist_ok=True)
            if not (run_dir / stage).exists():
                (run_dir / stage).symlink_to(os.path.relpath(shared / stage, run_dir))
        if own_vocab:
            run_logged(stage_cmd("03_build_vocab_map.py", args.config, overrides), run_dir / "logs" / "03.log")
        force = ["--force"] if args.force_train else []
        seconds = run_logged(stage_cmd("04_train.py", args.config, overrides, *force), run_dir / "logs" / "04.log")
        cpu_s = LAST_CPU_S[0]
        run_logged(stage_cmd("05_export.py", args.config, overrides, "--force"), run_dir / "logs" / "05.log")
        manifest = json.loads((run_dir / "04_train" / "manifest.json").read_text())
        config = load_config(args.config, overrides)
        evals = [json.loads(line) for line in (run_dir / "04_train" / "metrics.jsonl").read_text().splitlines()
                 if '"eval"' in line]
        record = {
            "trainer": name, "seed": seed, "run_dir": str(run_dir), "overrides": overrides,
            "train_wall_s": round(seconds, 1), "train_cpu_s": cpu_s,
            "train_tokens": manifest["counts"]["train_tokens_this_launch"],
            "train_tokens_planned": our_token_budget(config), "optimizer_steps": config.train.max_steps,
            "own_eval": {k: v for k, v in evals[-1].items() if k.startswith(("acc_", "loss_"))},
            "own_eval_definition": "04 metrics.jsonl, last eval record: teacher-forced top-1 agreement per TTT step",
            # 04's own simulated acceptance (fp32 checkpoint): the shared evaluator's, on the bf16 export, beside it
            "simulated_by_04": manifest["counts"].get("simulated_acceptance"),
            "export": str(run_dir / "05_export" / "reference"),
        }
        save(run_dir / "bench_train.json", record)
    clock.phase(f"train {name} seed {seed}", record["train_wall_s"])
    return record


def train_speculators(args, clock: Clock, shared: Path, seed: int, budget: int, config, name: str = "speculators",
                      extra: list[str] = ()) -> dict:
    """`speculators train` at our draft's shape and vocabulary on our 01-03, for the tokens ours trains on."""
    from bench.speculators_trainer import device_flags, outputs, train_batches, write_dataset
    from eagle3_pipeline.stage_io import fingerprint
    from eagle3_pipeline.target import target_path

    data_dir = args.run_dir / "speculators_data"
    facts = write_dataset(shared, data_dir)
    total_seq_len = config.train.packed_length
    inputs = {"budget": budget, "packed_length": total_seq_len, "extra": list(extra)}
    run_dir = args.run_dir / f"{name}_seed{seed}_{fingerprint(inputs)[:6]}"
    record = cached(run_dir / "bench_train.json", args.force_train)
    if record is not None:
        clock.phase(f"train {name} seed {seed}", record["train_wall_s"])
        return record
    shutil.rmtree(run_dir, ignore_errors=True)  # its trainer resumes from checkpoints it finds: start clean
    batches = train_batches(data_dir, total_seq_len, facts["train_data_ratio"], seed, epochs=50)
    max_steps, tokens = matched_steps(batches, budget)
    per_epoch = len(train_batches(data_dir, total_seq_len, facts["train_data_ratio"], seed, epochs=1))
    epochs = -(-max_steps // per_epoch)  # its loop runs whole epochs; max_steps cuts the last one
    cmd = [PY, "-m", "bench.speculators_trainer", "--verifier-name-or-path", str(target_path(config.target)),
           "--data-path", str(data_dir), "--save-path", str(run_dir / "checkpoints"),
           "--log-dir", str(run_dir / "logs"), "--seed", str(seed),
           # same shape: its defaults already synthesise 576 / 9 x 64 / 3 KV / 1536 from the verifier; the vocab:
           "--draft-vocab-size", str(config.draft.draft_vocab_size), "--d2t-path", str(shared / "03_vocab" / "d2t.npy"),
           "--t2d-path", str(shared / "03_vocab" / "t2d.npy"), "--target-layer-ids", *map(str, facts["aux_layer_ids"]),
           # same data, same budget, same batch
           "--train-data-ratio", repr(facts["train_data_ratio"]), "--total-seq-len", str(total_seq_len),
           "--max-steps", str(max_steps), "--epochs", str(epochs), "--on-missing", "raise", *device_flags(), *extra]
    seconds = run_logged(cmd, run_dir / "train.log")
    record = {"trainer": name, "seed": seed, "run_dir": str(run_dir), "command": cmd, "train_wall_s": round(seconds, 1),
              "train_cpu_s": LAST_CPU_S[0], "train_tokens": tokens, "optimizer_steps": max_steps, "epochs": epochs,
              "batches_per_epoch": per_epoch, **outputs(run_dir)}
    save(run_dir / "bench_train.json", record)
    clock.phase(f"train {name} seed {seed}", seconds)
    return record


def evaluated(record: dict, rows, config, ks: list[int], force: bool = False, device: str = "cpu") -> dict:
    """One draft's figures from the shared evaluator (bench/draft_eval.py) on `rows`, cached in its folder."""
    from bench.draft_eval import evaluate
    from eagle3_pipeline.target import target_path

    path = Path(record["run_dir"]) / f"bench_shared_eval_k{'_'.join(map(str, ks))}.json"
    values = cached(path, force)
    if values is None:
        values = evaluate(Path(record["export"]), rows, config.train.ttt_steps, ks, config.validate_.max_tokens,
                          device, target_path(config.target), config.target.weight_prefix)
        save(path, values)
    return values


def shared_eval(args, clock: Clock, shared: Path, records: list[dict], config) -> None:
    from bench.draft_eval import EvalRows

    started = time.perf_counter()
    rows = EvalRows(shared, config.train.packed_length)  # packed when the first uncached draft reads them
    for record in records:
        record["shared_eval"] = evaluated(record, rows, config, args.ks, args.force_train)
    clock.phase("shared teacher-forced eval", time.perf_counter() - started)


def acceptance(counts) -> dict:
    """vLLM's acceptance figures of a run or of one eval source's requests."""
    return {"mean_acceptance_length": counts.mean_acceptance_length,
            "mean_request_acceptance_length": counts.mean_request_acceptance_length,
            "acceptance_per_position": counts.acceptance_per_position}


def measure(args, clock: Clock, record: dict, k: int, config, prompts: list) -> dict:
    """06's vLLM acceptance run of one draft at k, cached in its folder."""
    from eagle3_pipeline.target import target_path
    from eagle3_pipeline.validate.acceptance import serve

    path = Path(record["run_dir"]) / f"bench_serve_k{k}_{len(prompts)}x{config.validate_.max_tokens}.json"
    result = cached(path, args.force_train)
    if result is None:
        started = time.perf_counter()
        run = serve(config, target_path(config.target), prompts, Path(record["export"]), k)
        result = {
            "k": k, **acceptance(run), "counters": run.counts.vllm_counters(),
            "generate_s": round(run.batch.seconds, 1), "engine_wall_s": round(time.perf_counter() - started, 1),
            "generated_tokens": run.generated_tokens, "skipped_parameters": run.skipped_parameters,
            "by_source": {source: {**acceptance(counts), "num_drafts": counts.counts.drafts,
                                   "prompts": len(counts.requests)} for source, counts in run.by_source.items()},
            "outputs": run.outputs,
        }
        save(path, result)
    clock.phase(f"vLLM k={k} {record['trainer']} seed {record['seed']}: mean acceptance length "
                f"{result['mean_acceptance_length']:.3f}", result["engine_wall_s"])
    return result


# ------------------------------------------------------------------------------------------------ report
def served_spread(records: list[dict], k: int) -> dict:
    """One draft's vLLM figures at k over its seeds, overall and per eval source, beside the simulated ones."""
    runs = [r["serve"][str(k)] for r in records]
    mal = [run["mean_acceptance_length"] for run in runs]
    positions = [[run["acceptance_per_position"][i] for run in runs] for i in range(k)]
    return {
        "mean_acceptance_length": statistics.fmean(mal), "mean_acceptance_length_spread": spread(mal),
        "acceptance_per_position": [statistics.fmean(p) for p in positions],
        "acceptance_per_position_min": [min(p) for p in positions],
        "acceptance_per_position_max": [max(p) for p in positions],
        "num_drafts": [run["counters"]["num_drafts"] for run in runs],
        "skipped_parameters": sorted({p for run in runs for p in run["skipped_parameters"]}),
        "simulated_mean_acceptance_length": spread([r["shared_eval"][metric_key(k)] for r in records]),
        "by_source": {source: {
            "mean_acceptance_length": spread([run["by_source"][source]["mean_acceptance_length"] for run in runs]),
            "simulated_mean_acceptance_length": spread([r["shared_eval"][metric_key(k, source=source)]
                                                        for r in records]),
            "acceptance_per_position": [statistics.fmean(run["by_source"][source]["acceptance_per_position"][i]
                                                         for run in runs) for i in range(k)],
            "prompts": runs[0]["by_source"][source]["prompts"],
        } for source in runs[0]["by_source"]},
    }


def summarize(records: list[dict], ks: list[int]) -> dict:
    """Per draft, every figure as a spread over its seeds."""
    out = {}
    for trainer in dict.fromkeys(r["trainer"] for r in records):
        mine = [r for r in records if r["trainer"] == trainer]
        out[trainer] = {
            "trainer": mine[0]["trainer_kind"], "layout": mine[0]["layout"], "seeds": [r["seed"] for r in mine],
            **{key: spread([r[key] for r in mine]) for key in ("train_wall_s", "train_tokens", "optimizer_steps")},
            "shared_eval": {key: spread([r["shared_eval"][key] for r in mine]) for key in mine[0]["shared_eval"]},
            "own_eval": [r["own_eval"] for r in mine], "own_eval_definition": mine[0]["own_eval_definition"],
            "k": {str(k): served_spread(mine, k) for k in ks if all(str(k) in r["serve"] for r in mine)},
        }
    return out


def work_seconds(stage_seconds: dict, records: list[dict], eval_s: float) -> dict:
    """What the main comparison costs from scratch (sum of its phases, cached ones included) and the ablations."""
    cost = lambda rs: sum(r["train_wall_s"] + sum(run["engine_wall_s"] for run in r["serve"].values()) for r in rs)  # noqa: E731
    return {"stages_01_03": {k: round(v, 1) for k, v in stage_seconds.items()},
            "main_comparison_total": round(sum(stage_seconds.values())
                                           + cost([r for r in records if r["trainer"] in MAIN]) + eval_s, 1),
            "ablations_total": round(cost([r for r in records if r["trainer"] not in MAIN]), 1)}


def identical_outputs(records: list[dict], ks: list[int]) -> dict:
    """Greedy outputs with either draft should be the target's own: share of prompts identical to the first run."""
    first = records[0]["serve"][str(ks[0])]["outputs"]
    return {f"{r['trainer']}_seed{r['seed']}_k{k}": sum(a == b for a, b in zip(first, r["serve"][str(k)]["outputs"]))
            / len(first) for r in records for k in ks if str(k) in r["serve"]}


# --------------------------------------------------------------------------------------------------- main
def parse_args():
    arguments = parser(__doc__)
    arguments.add_argument("--config", type=Path, default=Path("configs/demo.yaml"))
    arguments.add_argument("--run-dir", type=Path, default=Path("runs/bench_quality"))
    arguments.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    arguments.add_argument("--ks", type=int, nargs="+", default=[3, 5])
    arguments.add_argument("--max-steps", default="128", help="optimizer steps of our trainer (1024-row packs; "
                           "speculators gets the same tokens): the bench's training budget, sized for 45 minutes on 2 "
                           "CPU cores; 'config' = the config's train.max_steps")
    arguments.add_argument("--max-prompts", default="all", help="06's eval prompts served (the first N; all = every "
                           "served turn of the eval split)")
    arguments.add_argument("--max-tokens", type=int, default=48)
    arguments.add_argument("--out", type=Path, default=Path("bench/results/quality.json"))
    arguments.add_argument("--reuse-01", type=Path, help="copy this finished 01_data (same config) instead of running 01")
    arguments.add_argument("--variants", nargs="*", default=[], choices=sorted(ABLATIONS), help="ablations of ours")
    arguments.add_argument("--variant-seeds", type=int, nargs="*", help="seeds the ablations run at (default: --seeds)")
    arguments.add_argument("--variant-ks", type=int, nargs="*", help="k values the ablations are served at (default: "
                           "--ks)")
    arguments.add_argument("--train-only", action="store_true", help="stop after the trainings (no eval, vLLM, report)")
    arguments.add_argument("--force-train", action="store_true", help="retrain and remeasure everything")
    return arguments.parse_args()


def work_folder(args):
    """The run config of the shared stages, in one work folder per content of the sections stages 01-03 read (an
    edited config never meets stale stage outputs); sets args.budget and args.run_dir."""
    import yaml

    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.stage_io import fingerprint

    args.budget = [] if args.max_steps == "config" else [f"train.max_steps={int(args.max_steps)}"]
    base = load_config(args.config, args.budget)
    args.run_dir = args.run_dir / fingerprint({s: base.section(s) for s in SHARED_SECTIONS})[:10]
    max_prompts = "null" if args.max_prompts == "all" else int(args.max_prompts)
    if not (args.run_dir / "config.yaml").exists():  # the config this work folder's stages ran with
        args.run_dir.mkdir(parents=True, exist_ok=True)
        (args.run_dir / "config.yaml").write_text(yaml.safe_dump(base.model_dump(mode="json", by_alias=True),
                                                                 sort_keys=False))
    return load_config(args.config, [f"run_dir={args.run_dir / 'shared'}", f"validate.max_prompts={max_prompts}",
                                     f"validate.max_tokens={args.max_tokens}", *args.budget])


def train_all(args, clock: Clock, shared: Path, config) -> list[dict]:
    """Every draft of every seed (within a draft's folder, named by what it depends on: train_ours,
    train_speculators); speculators' drafts get the training tokens of ours at the same seed."""
    records = []
    for seed in args.seeds:
        budget = None
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
    return records


def write_report(args, clock: Clock, config, records: list[dict], prompts: list, stage_seconds: dict) -> None:
    clock.phases["total"] = round(time.perf_counter() - clock.start, 1)
    report = {
        "command": "HF_HUB_OFFLINE=1 .venv/bin/python -m bench.quality " + " ".join(sys.argv[1:]),
        "main": list(MAIN), "ablation_bases": {name: base for name, (base, _) in ABLATIONS.items()},
        "target": "SmolLM2-135M-Instruct (stand-in)", "config": str(args.config), "seeds": args.seeds, "ks": args.ks,
        "eval_prompts": len(prompts), "max_tokens": args.max_tokens, "ttt_steps": config.train.ttt_steps,
        "wall_time_s": clock.phases, "run_dir": str(args.run_dir),
        "machine": {"cpus": os.cpu_count(), "load_min": min(clock.load_averages, default=0.0),
                    "load_max": max(clock.load_averages, default=0.0), "load_at_phase_ends": clock.load_averages},
        "work_s": work_seconds(stage_seconds, records, clock.phases.get("shared teacher-forced eval", 0.0)),
        "draft_shape": config.section("draft"),
        "results": summarize(records, args.ks),
        "identical_greedy_outputs": identical_outputs(records, args.ks),
        "runs": [{k: v for k, v in r.items() if k != "serve"} | {"serve": {
            key: {f: x for f, x in run.items() if f != "outputs"} for key, run in r["serve"].items()}} for r in records],
        "notes": NOTES,
    }
    # every invocation that wrote this report, with its wall time (a rerun reuses the cached work of earlier ones)
    previous = cached(args.out) or {}
    if previous.get("run_dir") != report["run_dir"]:  # another config's report: its invocations are not this one's
        previous = {}
    invocations = previous.get("invocations") or (
        [{"command": previous["command"], "wall_s": previous["wall_time_s"]["total"]}] if "wall_time_s" in previous else [])
    report["invocations"] = invocations + [{"command": report["command"], "wall_s": clock.phases["total"]}]
    save(args.out, report)
    print(render("quality", args.out))
    clock.say(f"wrote {args.out}, {args.out.with_suffix('.md')}, {args.out.with_suffix('.png')}")


def main() -> None:
    args = parse_args()
    os.chdir(ROOT)
    if len(args.seeds) < 2:
        print("note: fewer than 2 seeds gives no spread", file=sys.stderr)
    clock = Clock()
    config = work_folder(args)
    shared = args.run_dir / "shared"
    clock.say(f"shared stages 01-03 in {shared}")
    stage_seconds = shared_stages(args, clock, shared)
    records = train_all(args, clock, shared, config)
    if args.train_only:
        clock.say("--train-only: trainings done")
        return
    shared_eval(args, clock, shared, records, config)

    from eagle3_pipeline.validate.stage import eval_prompts  # 06's prompts: 01's eval split, first max_prompts

    prompts = eval_prompts(config)
    for record in records:
        ks = args.ks if record["trainer"] in MAIN else (args.variant_ks or args.ks)
        record["serve"] = {str(k): measure(args, clock, record, k, config, prompts) for k in ks}
    write_report(args, clock, config, records, prompts, stage_seconds)


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
