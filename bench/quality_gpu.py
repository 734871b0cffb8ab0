"""Draft quality at scale on one GPU: the learning curve of our trainer against speculators 0.9.0's, the levers
at the largest budget, three seeds there, and regeneration with the trained draft.

    python -m bench.quality_gpu --work /tmp/quality_gpu --out /tmp/out          # one H200: every phase, in order
    python -m bench.quality_gpu --config bench/quality_gpu_kimi.yaml --work W --out O   # the learned tiny Kimi
    python -m bench.quality_gpu --report bench/results/quality_gpu.json        # tables and PNG from the JSON

Phases (each skips the work a rerun finds complete; `--phases` picks some):

    data     stages 01-03 once on bench/quality_gpu.yaml (--reuse-01: an earlier run's 01_data): SmolLM2-135M-Instruct
             regenerates every answer, five held-out eval benchmarks (MT-Bench both turns, HumanEval, GSM8K,
             MATH500, BFCL where the target's template renders tools)
    train    the curve (our trainer and `speculators train` at each of --curve-steps, seed 0: speculators gets the
             tokens ours trains on at that step count, same batch shape), seeds 1 and 2 at the largest point, and
             each lever of LEVERS (ours) and THEIR_LEVERS (speculators' own layouts) at the largest point
             (--lever-seeds); --parallel trainings share the GPU. Every
             draft is scored by one shared evaluator on the GPU (bench/draft_eval.py: 04's simulated acceptance
             length per eval benchmark at k=3, teacher-forced accuracies)
    regen    01's regeneration of --regen-conversations magpie conversations at 01's concurrency, without and
             with the largest seed-0 draft of ours as its speculative draft (`data.regenerate.speculative`): the
             generated tokens/s and acceptance 01's stats.json reports, alone on the GPU
    serve    vLLM's own counters (06's `serve`, CUDA graphs off: acceptance does not depend on them) for the final
             rows: ours and speculators seed 0 at the largest point, ours at the smallest, and the best lever, one
             engine each, all at once

Writes <out>/quality_gpu.json after every draft, so a run cut short keeps what was measured; `--report` turns it
into quality_gpu.md and quality_gpu.png beside it.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.harness import MLA_HEADS, ROOT, Clock, cached, offline, parser, run_logged, save, stage_cmd
from bench.quality import SHARED_SECTIONS, evaluated, measure, our_token_budget, shared_stages, train_ours, train_speculators
from bench.report import quality_gpu_markdown, render
from eagle3_pipeline.acceptance import metric_key

offline()
CONFIG = Path("bench/quality_gpu.yaml")
K = 3
TTT_DECAY = [round(0.8 ** step, 6) for step in range(7)]
# One setting moved from bench/quality_gpu.yaml's train/draft sections, ours, at the largest point, seed 0
LEVERS: dict[str, list[str]] = {
    "eagle3.1": ["draft.fc_norm=true", "draft.norm_output=true", "train.standardize_aux=false"],
    "eagle3.1-muon": ["draft.fc_norm=true", "draft.norm_output=true", "train.standardize_aux=false",
                      "train.optimizer=muon"],
    "standardize_aux-off": ["train.standardize_aux=false"],
    "ttt7-decay0.8": ["train.ttt_steps=7", f"train.ttt_step_weights={TTT_DECAY}"],
    "loss-tv": ["train.loss=tv"],
    "loss-lk": ["train.loss=lk"],
    "loss-lk_alpha": ["train.loss=lk_alpha"],
    "lr-warmup5pc-cosine-to-0": ["train.warmup_steps={warmup}", "train.min_lr_ratio=0.0"],
    "lr-3e-3": ["train.learning_rate=3.0e-3"],
    "fp8": ["train.fp8=true"],
    "optimizer-muon": ["train.optimizer=muon"],  # speculators' default optimizer
    # Muon's rate either side of the 1e-3 it gained 4% at (bench/quality_gpu.yaml's, tuned with AdamW), where both
    # trainers' curves still climb at the largest budget
    "muon-lr5e-4": ["train.optimizer=muon", "train.learning_rate=5.0e-4"],
    "muon-lr2e-3": ["train.optimizer=muon", "train.learning_rate=2.0e-3"],
    # with Muon, lm_head (4.7M of the draft's 9.8M trainable parameters) is the one large matrix left on AdamW;
    # speculators' trainer keeps it frozen at the verifier's rows
    "muon-frozen-lm_head": ["train.optimizer=muon", "train.freeze_lm_head=true"],
    # the MLA attention layer (docs/draft_layouts.md), without and with EAGLE 3.1's norms; vLLM serves it only
    # beside an MLA target (bench/quality_gpu_kimi.yaml): on SmolLM2 its figures are the simulation's alone
    "mla": [*MLA_HEADS, "draft.q_lora_rank=64"],
    "mla-eagle3.1": [*MLA_HEADS, "draft.q_lora_rank=64", "draft.fc_norm=true", "draft.norm_output=true",
                     "train.standardize_aux=false"],
    # the MLA layer's query through a rank of half the layer's input (2 x hidden) rather than the 64 above (an eighth
    # of the tiny Kimi's 512, about Kimi-K2.5's proportion, 1536 of 14336): whether the low-rank query is what it
    # loses to the Llama layer's full-rank q_proj on
    "mla-q_lora-half": [*MLA_HEADS, "draft.q_lora_rank={hidden}"],
    # the draft over the target's whole vocabulary (no d2t/t2d; docs/draft_layouts.md), its own 03; the loss a chunk
    # of rows at a time (the same values), so that its [rows, vocab] float32 logits do not crowd the GPU it shares
    "full-vocab": ["draft.draft_vocab_size={target_vocab}", "train.loss_chunk_rows=1024"],
}
# speculators' trainer in its own layouts, like with like for ours: `speculators train` flags added to the defaults
# it trains with otherwise
THEIR_LEVERS: dict[str, list[str]] = {
    # EAGLE 3.1's per-layer norms of the aux states before fc (its `--fc-norm`, which excludes its default single
    # norm over their concatenation); its norm_output is on already by default
    "speculators.eagle3.1": ["--fc-norm", "--no-norm-before-fc"],
}
SERVE_MEMORY_SHARE = 0.2  # of the GPU's memory that each of the serve phase's (up to 4) engines checks is free
LOCK = threading.Lock()


class Bench:
    """The bench's work folder, its shared stages, and quality_gpu.json written after every record."""

    def __init__(self, args):
        from eagle3_pipeline.config import load_config
        from eagle3_pipeline.stage_io import fingerprint

        self.args = args
        self.clock = Clock()
        base = load_config(args.config, [])
        args.run_dir = args.work / fingerprint({s: base.section(s) for s in SHARED_SECTIONS})[:10]
        args.budget, args.force_train = [], False
        self.shared = args.run_dir / "shared"
        self.config = load_config(args.config, [f"run_dir={self.shared}"])
        self.out = args.out / "quality_gpu.json"
        self.report = cached(self.out) or {}
        command = "python -m bench.quality_gpu " + " ".join(sys.argv[1:])
        self.report.setdefault("commands", []).append(command)  # a rerun adds to the work of earlier ones
        self.report.update({"config": str(args.config), "curve_steps": args.curve_steps, "k": K,
                            "target": self.config.target.stand_in or self.config.target.path, "gpu": gpu_name()})
        self.report.setdefault("drafts", {})

    def record(self, key: str, value, within: str | None = None) -> None:
        """report[key] (report[within][key]) = value, and quality_gpu.json saved."""
        with LOCK:
            (self.report[within] if within else self.report)[key] = value
            save(self.out, self.report)


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"


# ----------------------------------------------------------------------------------------------------- data
def phase_data(bench: Bench) -> None:
    seconds = shared_stages(bench.args, bench.clock, bench.shared)
    from eagle3_pipeline.data.dataset import open_split

    stats = json.loads((bench.shared / "01_data" / "stats.json").read_text())
    bench.record("data", {"stage_seconds": seconds, "train_conversations": len(open_split(bench.shared / "01_data", "train")),
                          "train_tokens": stats["train"]["tokens"], "loss_tokens": stats["train"]["loss_tokens"],
                          "generation": stats["generation"]})


# ---------------------------------------------------------------------------------------------------- train
def draft_jobs(args) -> list[tuple[str, str, int, int, list[str]]]:
    """(name, trainer, steps, seed, extra overrides) of every draft, in the order they matter: the curve from its
    largest point (both trainers), the seeds, then the levers."""
    from eagle3_pipeline.config import ConfigError, load_config

    largest = max(args.curve_steps)
    jobs = []
    if "curve" in args.jobs:
        jobs += [(f"{trainer}-{steps}-s0", trainer, steps, 0, []) for steps in sorted(args.curve_steps, reverse=True)
                 for trainer in ("ours", "speculators")]
    if "seeds" in args.jobs:  # seed 0 too, when the curve (which trains it) is not asked for
        jobs += [(f"{trainer}-{largest}-s{seed}", trainer, largest, seed, [])
                 for seed in ((1, 2) if "curve" in args.jobs else (0, 1, 2)) for trainer in ("ours", "speculators")]
    asked = dict(lever_seeds(item, args.lever_seeds) for item in args.levers or [])
    if "levers" not in args.jobs:
        return jobs
    config = load_config(args.config, [])  # what the levers' settings name in braces is read from
    for lever in asked or [*LEVERS, *THEIR_LEVERS]:  # in the order asked
        if lever in THEIR_LEVERS:
            jobs += [(f"{lever}-{largest}-s{seed}", "speculators", largest, seed, THEIR_LEVERS[lever])
                     for seed in asked.get(lever, args.lever_seeds)]
            continue
        if lever not in LEVERS:
            raise SystemExit(f"--levers {lever}: not one of {', '.join([*LEVERS, *THEIR_LEVERS])}")
        values = lever_values(config, largest, LEVERS[lever])
        overrides = [o.format(**values) for o in LEVERS[lever]]
        try:
            load_config(args.config, overrides)
        except ConfigError as err:  # a lever this checkout does not have
            print(f"lever {lever} skipped: {err}", flush=True)
            continue
        jobs += [(f"{lever}-{largest}-s{seed}", "ours", largest, seed, overrides)
                 for seed in asked.get(lever, args.lever_seeds)]
    return jobs


def lever_values(config, largest: int, lever: list[str]) -> dict:
    """What a lever's settings name in braces, from the bench's `config`: {warmup} (5% of the largest budget),
    {hidden} (the draft's hidden size), {target_vocab} (the target's vocabulary size, read from the target only for
    a lever that names it)."""
    values = {"warmup": max(1, largest // 20), "hidden": config.draft.hidden_size}
    if any("{target_vocab}" in setting for setting in lever):
        from eagle3_pipeline.target import target_facts

        values["target_vocab"] = target_facts(config)["vocab_size"]
    return values


def lever_seeds(item: str, default: list[int]) -> tuple[str, list[int]]:
    """`NAME` trains at --lever-seeds, `NAME@0,1,2` at those seeds."""
    name, _, seeds = item.partition("@")
    try:
        return name, [int(seed) for seed in seeds.split(",")] if seeds else default
    except ValueError:
        raise SystemExit(f"--levers {item}: seeds are integers, as in {name}@0,1,2") from None


def phase_train(bench: Bench) -> None:
    import torch

    from bench.draft_eval import EvalRows
    from bench.speculators_trainer import write_dataset
    from eagle3_pipeline.capture.store import open_reader
    from eagle3_pipeline.config import load_config

    config = bench.config
    _, layout = open_reader(bench.shared / "02_hidden_states")
    rows = EvalRows(bench.shared, config.train.packed_length)
    rows.batches(len(layout.aux_layer_ids) * config.draft.hidden_size, config.draft.hidden_size)  # once, here
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dataset = threading.Thread(target=write_dataset, args=(bench.shared, bench.args.run_dir / "speculators_data"))
    dataset.start()

    def run(job) -> None:
        name, trainer, steps, seed, extra = job
        if name in bench.report["drafts"] and "shared_eval" in bench.report["drafts"][name]:
            return
        started = time.perf_counter()
        args = copy.copy(bench.args)
        args.budget = [f"train.max_steps={steps}"]
        try:
            if trainer == "ours":
                record = train_ours(args, bench.clock, bench.shared, name, seed, extra)
            else:
                ours = load_config(args.config, [f"run_dir={bench.shared}", f"train.max_steps={steps}",
                                                 f"train.seed={seed}"])
                dataset.join()
                record = train_speculators(args, bench.clock, bench.shared, seed, our_token_budget(ours), config,
                                           name=name.removesuffix(f"-{steps}-s{seed}"), extra=extra)
            record["shared_eval"] = evaluated(record, rows, config, [K], device=device)
        except Exception as err:  # noqa: BLE001 - one failed draft is reported, the others go on
            record = {"error": repr(err)[-2000:]}
        bench.record(name, record | {"trainer_kind": trainer, "steps": steps, "seed": seed, "extra": extra,
                                     "job_wall_s": round(time.perf_counter() - started, 1)}, within="drafts")
        bench.clock.say(f"{name}: {summary_line(bench.report['drafts'][name])}")

    with ThreadPoolExecutor(bench.args.parallel) as pool:
        list(pool.map(run, draft_jobs(bench.args)))
    dataset.join()
    if device == "cuda":  # the evaluations' cached blocks (35 GiB on an H100) would starve the serve phase's engines
        rows = None
        torch.cuda.empty_cache()


def summary_line(record: dict) -> str:
    if "error" in record:
        return "failed: " + record["error"].splitlines()[-1][:300]
    values = record["shared_eval"]
    return f"{record['train_tokens']} tokens, {record['train_wall_s']:.0f} s, simulated AL k={K} {values[metric_key(K)]:.3f}"


# ---------------------------------------------------------------------------------------------------- serve
def drafts_to_serve(drafts: dict, curve_steps: list[int], served: dict) -> list[str]:
    """The final rows not yet served: ours and speculators seed 0 at the largest point, ours at the smallest, and
    the lever with the best simulated AL at the largest point."""
    largest, smallest = max(curve_steps), min(curve_steps)
    chosen = [f"ours-{largest}-s0", f"speculators-{largest}-s0", f"ours-{smallest}-s0"]
    levers = [n for n, r in drafts.items() if n.endswith(f"-{largest}-s0") and "shared_eval" in r
              and not n.startswith(("ours-", "speculators-"))]
    if levers:
        chosen.append(max(levers, key=lambda n: drafts[n]["shared_eval"][metric_key(K)]))
    return [name for name in dict.fromkeys(chosen) if name in drafts and "error" not in drafts[name]
            and name not in served]


def phase_serve(bench: Bench) -> None:
    """One engine per chosen draft, each in its own process and all at once (engine starts dominate the phase);
    each process leaves its result in measure()'s cache, which the records here are read from."""
    import multiprocessing

    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.validate.stage import eval_prompts

    drafts = bench.report["drafts"]
    # acceptance does not depend on CUDA graphs: no compilation; the engines share the GPU
    config = load_config(bench.args.config, [f"run_dir={bench.shared}", "target.engine.enforce_eager=true",
                                             f"target.engine.gpu_memory_utilization={SERVE_MEMORY_SHARE}"])
    prompts = eval_prompts(config)
    served = bench.report.setdefault("served", {})
    todo = drafts_to_serve(drafts, bench.args.curve_steps, served)
    spawn = multiprocessing.get_context("spawn")
    engines = {name: spawn.Process(target=measure, args=(bench.args, Clock(), dict(drafts[name], trainer=name), K,
                                                         config, prompts)) for name in todo}
    for process in engines.values():
        process.start()
    for name, process in engines.items():
        process.join()
        if process.exitcode:  # not recorded: a rerun serves it again
            bench.clock.say(f"serve {name}: its process exited with {process.exitcode} (log above)")
            continue
        result = measure(bench.args, bench.clock, dict(drafts[name], trainer=name), K, config, prompts)  # cached
        served[name] = {key: value for key, value in result.items() if key != "outputs"}
        bench.record("served", served)


# ---------------------------------------------------------------------------------------------------- regen
def phase_regen(bench: Bench) -> None:
    """01 on the same magpie conversations twice, without and with the draft: generation figures from stats.json."""
    largest = max(bench.args.curve_steps)
    draft = bench.report["drafts"].get(f"ours-{largest}-s0", {}).get("export")
    if not draft:
        print("regen skipped: no trained draft", flush=True)
        return
    source = f"{{kind: magpie, limit: {bench.args.regen_conversations}, temperature: 1.0, max_tokens: 48}}"
    results = bench.report.setdefault("regeneration", {})
    for name, extra in (("target alone", []), (f"with ours-{largest}-s0, k={K}", [
            f"data.regenerate.speculative={{draft: {draft}, num_speculative_tokens: {K}}}"])):
        if name in results:
            continue
        run_dir = bench.args.run_dir / ("regen-" + ("plain" if not extra else "speculative"))
        overrides = [f"run_dir={run_dir}", f"data.sources=[{source}]", "data.eval_sources=[{kind: mtbench, limit: 4}]",
                     *extra]
        seconds = run_logged(stage_cmd("01_prepare_data.py", bench.args.config, overrides), run_dir / "01.log")
        stats = json.loads((run_dir / "01_data" / "stats.json").read_text())
        results[name] = {"stage_wall_s": round(seconds, 1), "generation": stats.get("generation"),
                         "overrides": overrides}
        bench.record("regeneration", results)
        bench.clock.say(f"regeneration {name}: {stats.get('generation')}")


# ----------------------------------------------------------------------------------------------------- main
PHASES = {"data": phase_data, "train": phase_train, "regen": phase_regen, "serve": phase_serve}


def parse_args():
    arguments = parser(__doc__)
    arguments.add_argument("--config", type=Path, default=CONFIG)
    arguments.add_argument("--work", type=Path, default=Path("runs/bench_quality_gpu"))
    arguments.add_argument("--out", type=Path, default=Path("bench/results"))
    arguments.add_argument("--curve-steps", type=int, nargs="+", default=[40, 160, 320, 640],
                           help="our optimizer steps (one 8192-row pack each) at each curve point")
    arguments.add_argument("--levers", nargs="*",
                           help=f"of {', '.join([*LEVERS, *THEIR_LEVERS])} (default: all this checkout has); "
                           "NAME@0,1,2 trains that lever at those seeds instead of --lever-seeds")
    arguments.add_argument("--jobs", nargs="+", default=["curve", "seeds", "levers"],
                           choices=["curve", "seeds", "levers"],
                           help="which drafts the train phase trains (seeds: both trainers at the largest point)")
    arguments.add_argument("--lever-seeds", type=int, nargs="+", default=[0], help="seeds each lever trains at")
    arguments.add_argument("--parallel", type=int, default=6, help="trainings sharing the GPU at once")
    arguments.add_argument("--regen-conversations", type=int, default=1024)
    arguments.add_argument("--reuse-01", type=Path, help="a complete 01_data of this config from an earlier run "
                           "(copied; 01's regeneration is then skipped)")
    arguments.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    arguments.add_argument("--report", type=Path, help="only write the .md and .png of this quality_gpu.json")
    return arguments.parse_args()


def main() -> None:
    args = parse_args()
    os.chdir(ROOT)
    if args.report:
        print(render("quality_gpu", args.report))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    bench = Bench(args)
    for phase in args.phases:
        started = time.perf_counter()
        PHASES[phase](bench)
        bench.clock.phase(f"phase {phase}", time.perf_counter() - started)
        bench.record("phase_seconds", bench.clock.phases)
    print(quality_gpu_markdown(bench.report))


if __name__ == "__main__":
    main()
