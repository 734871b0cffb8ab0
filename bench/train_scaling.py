"""Stage 04 on several GPUs against one: loss curve, tokens/s per GPU, scaling efficiency, cross-count resume.

For each draft shape (the demo config's draft, the Kimi-K2.5 draft of configs/kimi_k25.yaml) it fabricates the
inputs of 04 in --work: a target folder holding only the three tensors 04 reads (embed_tokens, norm, lm_head;
random values, the real shapes and names), 01_data of random token ids, 02_hidden_states of random states,
03_vocab by the real stage. Then it runs 04_train.py as a user would, at one global batch of G packs per step
(G = the largest process count asked for), every run in its own run_dir:

    one          python 04_train.py --config C --set train.grad_accumulation=G                     (1 GPU)
    multi_P      accelerate launch --multi_gpu --num_processes P 04_train.py --config C \
                     --set train.grad_accumulation=G/P
    chain_P_1_P  one run_dir, three launches: P processes stopped at step K (--stop-at-step K), continued by
                 1 process (--resume --set train.grad_accumulation=G --stop-at-step K2), finished by P processes
                 (--resume --set train.grad_accumulation=G/P): checkpoints resumed under another process count
    one_again    one, repeated: the run-to-run noise floor                                        (demo only)
    one_half     1 process at half the global batch: how far a real change moves the curve        (demo only)

Reported per shape: every run's train/eval metrics per step; per comparison (multi, the chain and the controls
against one) the largest absolute and relative difference of each TTT step's loss and accuracy, and whether the
loss stays within the tolerance of the run's precision; tokens/s (median over steps >= --measure-from, the
compile warm-up and the step after a checkpoint excluded) in all and per GPU, MFU, and the scaling efficiency
per_gpu(P) / per_gpu(1). Runs go in priority order and are skipped when --deadline-s would be passed; --runs
picks some, and --reference adds the runs of an earlier result (same shapes and code) to compare against.
The JSON is rewritten after every launch.

    python -m bench.train_scaling --out bench/results/train_scaling_h200x2.json     # 2 GPUs: all runs, ~20 min
    python -m bench.train_scaling --processes 2 4 8 --out ...                         # a node of 8 GPUs
    python -m bench.train_scaling --shapes tiny --out /tmp/train_scaling_cpu.json     # CPU smoke test (gloo), ~2 min

bench/results/train_scaling_h200x2.json was made in two 10-minute leases of a 2 x H200 machine:

    python -m bench.train_scaling --out R.json --deadline-s 520          # one, multi_2 of both shapes
    python -m bench.train_scaling --shapes kimi demo --runs chain_2_1_2 one_half --reference R.json \
        --out bench/results/train_scaling_h200x2.json --deadline-s 425  # the cross-count chains

On GPU the multi-process runs use `accelerate launch --multi_gpu` (NCCL; NVLink multicast is kept off:
NCCL_NVLS_ENABLE=0); on CPU `torch.distributed.run` (gloo), since `accelerate launch --cpu` starts one process.
Needs what 04_train.py needs; where `openai` is missing (speculators imports it, 04 never calls it) an empty
stand-in package is put on the launched processes' PYTHONPATH.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import yaml

from bench.harness import RESULTS, ROOT, failure, parser, save, stand_ins, versions

# Shapes: the base config, the target's facts (what the fabricated target folder holds) and the run's size.
SHAPES = {
    "demo": {
        "config": "configs/demo.yaml", "hidden": 576, "vocab": 49152, "prefix": "", "tied": True,
        "aux_layer_ids": [2, 15, 27], "train_samples": 240, "eval_samples": 8, "lengths": (40, 200),
        "steps": 20, "resume_at": 10, "measure_from": 6, "controls": True,
        "train": {"log_every": 1},
    },
    "kimi": {
        "config": "configs/kimi_k25.yaml", "hidden": 7168, "vocab": 163840, "prefix": "language_model.",
        "tied": False, "aux_layer_ids": [2, 30, 58], "train_samples": 24, "eval_samples": 2,
        "lengths": (200, 3500), "steps": 20, "resume_at": 10, "measure_from": 6, "controls": False,
        # the production warm-up (500 steps) would leave the learning rate near 0 for the whole benchmark
        "train": {"log_every": 1, "warmup_steps": 4},
    },
    "tiny": {  # CPU smoke test: the tests' tiny draft on the demo config
        "config": "configs/demo.yaml", "hidden": 64, "vocab": 512, "prefix": "", "tied": True,
        "aux_layer_ids": [1, 2, 3], "train_samples": 24, "eval_samples": 6, "lengths": (10, 40),
        "steps": 6, "resume_at": 3, "measure_from": 2, "controls": True,
        "draft": {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                  "intermediate_size": 128, "draft_vocab_size": 128, "max_position_embeddings": 1024},
        "train": {"log_every": 1, "packed_length": 64, "learning_rate": 3e-3, "warmup_steps": 2,
                  "num_workers": 0},
    },
}
# Loss-curve tolerance (largest relative difference of any TTT step's loss at any step), by precision. Same
# packs, same kernels per pack: what differs is the order of the gradient sum (DDP's all-reduce average against
# accumulation) and non-deterministic kernels, which perturb the weights at the last bits of their precision,
# and the perturbation grows with training. fp32 keeps it far below 1e-3; bf16 autocast rounds every matrix
# product to 8 bits of mantissa (relative 4e-3), so a perturbation reaches ~1e-2. A real fault (another batch,
# a wrong average, a lost step) moves the loss by tens of percent: see the demo's one_half control.
TOLERANCE = {"no": 1e-3, "bf16": 2e-2, "fp16": 2e-2}
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def parse_args():
    arguments = parser(__doc__)
    arguments.add_argument("--shapes", nargs="+", choices=list(SHAPES), help="default: demo kimi (GPU), tiny (CPU)")
    arguments.add_argument("--processes", nargs="+", type=int, help="process counts besides 1 (default: the GPU "
                           "count, 2 on CPU); the global batch is the largest")
    arguments.add_argument("--work", type=Path, default=Path("/tmp/eagle3_train_scaling"), help="inputs and run dirs")
    arguments.add_argument("--out", type=Path, default=RESULTS / "train_scaling.json")
    arguments.add_argument("--log", type=Path, help="all runs' output, one file (default: beside --out)")
    arguments.add_argument("--deadline-s", type=float, default=math.inf, help="skip runs that would end later")
    arguments.add_argument("--runs", nargs="+", help="only these runs (one, multi_P, chain_P_1_P, one_again, one_half)")
    arguments.add_argument("--reference", type=Path, help="an earlier result whose runs are compared against here")
    arguments.add_argument("--keep", action="store_true", help="keep --work (default: deleted at the end)")
    args = arguments.parse_args()
    cuda = torch.cuda.is_available()
    args.shapes = args.shapes or (["demo", "kimi"] if cuda else ["tiny"])
    args.processes = sorted(set(args.processes or [max(2, torch.cuda.device_count()) if cuda else 2]))
    if cuda and max(args.processes) > torch.cuda.device_count():
        arguments.error(f"--processes {max(args.processes)}: this node has {torch.cuda.device_count()} GPUs")
    args.log = args.log or args.out.with_suffix(".log")
    return args


def main() -> None:
    args = parse_args()
    started, cuda, processes = time.monotonic(), torch.cuda.is_available(), args.processes
    args.log.parent.mkdir(parents=True, exist_ok=True)
    args.log.write_text("")
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    bench = Bench(args.work, cuda, args.log, started, args.deadline_s)
    result = {"device": device_name(cuda), "gpus": torch.cuda.device_count() if cuda else 0,
              "processes": processes, "global_batch_packs": max(processes), "versions": versions(),
              "topology": topology() if cuda else None, "tolerance_rel_loss": TOLERANCE, "shapes": {}}
    plans = prepare_shapes(bench, args, result)
    for name, run, legs in schedule(plans, processes):
        if args.runs and run not in args.runs:
            continue
        entry = result["shapes"][name]
        entry["runs"][run] = record = {"legs": []}
        for leg in legs:
            done = bench.run_leg(name, run, leg, plans[name], record)
            entry.update(summarize(entry["runs"], plans[name]["shape"], plans[name]["precision"], processes))
            save(args.out, result, indent=1)
            if not done:
                break
        bench.finish_run(run, plans[name], record)
        entry.update(summarize(entry["runs"], plans[name]["shape"], plans[name]["precision"], processes))
        save(args.out, result, indent=1)
    print_summary(result)
    save(args.out, result, indent=1)
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    print(f"wrote {args.out} and {args.log} in {time.monotonic() - started:.0f} s")


def prepare_shapes(bench, args, result: dict) -> dict:
    """Each shape's inputs (a shape that fails is recorded and left out), with the runs of --reference."""
    reference = json.loads(args.reference.read_text()) if args.reference else {"shapes": {}}
    if args.reference:
        result["reference"] = {"file": str(args.reference), "device": reference.get("device"),
                               "versions": reference.get("versions")}
    plans = {}
    for name in args.shapes:
        earlier = reference["shapes"].get(name, {}).get("runs", {})
        entry = result["shapes"][name] = {"runs": {run: {**record, "from_reference": True}
                                                   for run, record in earlier.items() if record.get("returncode") == 0}}
        try:
            plans[name] = bench.prepare(name, SHAPES[name], max(args.processes), entry)
        except Exception as err:  # noqa: BLE001 - one shape failing must not lose the others
            entry["error"] = failure(err, 3000)
            print(f"{name}: inputs failed: {entry['error']}", flush=True)
        save(args.out, result, indent=1)
    return plans


# ------------------------------------------------------------------------------------------ the plan
def schedule(plans: dict, processes: list[int]):
    """(shape, run, legs) in priority order: the curves and throughput, the cross-count chain, the controls.

    A leg is (processes, grad_accumulation, stop_at_step or None); a run's legs share its run_dir.
    """
    global_batch, p = max(processes), processes[-1]
    queue = []
    for name in plans:
        queue.append((name, "one", [(1, global_batch, None)]))
        queue += [(name, f"multi_{q}", [(q, global_batch // q, None)]) for q in processes]
    for name, plan in plans.items():
        shape = plan["shape"]
        first, second = shape["resume_at"], (shape["resume_at"] + shape["steps"]) // 2
        queue.append((name, f"chain_{p}_1_{p}", [(p, global_batch // p, first), (1, global_batch, second),
                                                 (p, global_batch // p, None)]))
    for name, plan in plans.items():
        if plan["shape"]["controls"]:
            queue.append((name, "one_again", [(1, global_batch, None)]))
            if global_batch % 2 == 0:
                queue.append((name, "one_half", [(1, global_batch // 2, None)]))
    return queue


def config_tree(shape: dict, target: Path) -> dict:
    tree = yaml.safe_load((ROOT / shape["config"]).read_text())
    tree["target"] |= {"path": str(target), "stand_in": None, "weight_prefix": shape["prefix"]}
    tree["capture"]["aux_layer_ids"] = shape["aux_layer_ids"]
    tree["draft"] |= shape.get("draft", {})
    steps, resume_at = shape["steps"], shape["resume_at"]
    tree["train"] |= {"max_steps": steps, "eval_every": steps, "checkpoint_every": resume_at,
                      "keep_checkpoints": 3, **shape.get("train", {})}
    return tree


# ---------------------------------------------------------------------------------------- the bench
class Bench:
    def __init__(self, work: Path, cuda: bool, log_path: Path, started: float, deadline_s: float):
        self.work, self.cuda, self.log_path = work, cuda, log_path
        self.started, self.deadline_s = started, deadline_s
        self.port = 29600
        self.env = {**os.environ, **MULTICAST_OFF, "PYTHONUNBUFFERED": "1",
                    "OMP_NUM_THREADS": "4" if cuda else "1"}  # the same in every launch, 1 and P processes
        stubs = stand_ins(work / "stubs")
        if stubs:
            self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [stubs, self.env.get("PYTHONPATH")]))

    def remaining(self) -> float:
        return self.deadline_s - (time.monotonic() - self.started)

    def prepare(self, name: str, shape: dict, global_batch: int, entry: dict) -> dict:
        """The shape's config file and finished 01/02/03 in <work>/<name>/inputs."""
        from eagle3_pipeline.config import load_config

        start = time.monotonic()
        folder = self.work / name
        tree = config_tree(shape, folder / "target")
        config_path = folder / "config.yaml"
        config_path.parent.mkdir(parents=True)
        config_path.write_text(yaml.safe_dump(tree, sort_keys=False))
        config = load_config(config_path, [f"run_dir={folder / 'inputs'}"])
        device = torch.device("cuda" if self.cuda else "cpu")
        write_target(folder / "target", shape, device)
        counts = fabricate_inputs(config, shape, device)
        train = config.train
        entry["config"] = {
            "base": shape["config"], "file": str(config_path), "draft": config.section("draft"),
            "target_vocab": shape["vocab"], "aux_layer_ids": shape["aux_layer_ids"],
            "packed_length": train.packed_length, "global_batch_packs": global_batch, "max_steps": train.max_steps,
            "resume_at": shape["resume_at"], "measure_from": shape["measure_from"],
            "mixed_precision": train.mixed_precision, "attention": train.attention, "compile": train.compile,
            "num_workers": train.num_workers, "learning_rate": train.learning_rate,
            "warmup_steps": train.warmup_steps, "tolerance_rel_loss": TOLERANCE[train.mixed_precision],
        }
        entry["inputs"] = {**counts, "fabricate_s": round(time.monotonic() - start, 1)}
        print(f"{name}: inputs in {entry['inputs']['fabricate_s']} s: {counts}", flush=True)
        return {"folder": folder, "config_path": config_path, "shape": shape, "precision": train.mixed_precision}

    def run_leg(self, name: str, run: str, leg: tuple, plan: dict, record: dict) -> bool:
        """One launch of `run` (in its run_dir); False when it was skipped or failed."""
        run_dir = plan["folder"] / run
        procs, accumulation, stop = leg
        first = not record["legs"]
        if first:
            record |= {"processes": procs, "grad_accumulation": accumulation}
        estimate = plan.get("estimate_s", 0) * (1.0 if first else 1.1)  # a resumed leg also loads a checkpoint
        if self.remaining() < estimate:
            record["skipped"] = (f"leg {len(record['legs']) + 1}: about {estimate:.0f} s needed, "
                                 f"{self.remaining():.0f} s left before --deadline-s")
            print(f"{name}/{run}: skipped ({record['skipped']})", flush=True)
            return False
        for stage in ("01_data", "02_hidden_states", "03_vocab") if first else ():
            (run_dir / stage).parent.mkdir(parents=True, exist_ok=True)
            (run_dir / stage).symlink_to(plan["folder"] / "inputs" / stage)
        sets = [f"run_dir={run_dir}", f"train.grad_accumulation={accumulation}"]
        argv = ["04_train.py", "--config", str(plan["config_path"]), *[a for s in sets for a in ("--set", s)]]
        argv += ([] if first else ["--resume"]) + ([] if stop is None else ["--stop-at-step", str(stop)])
        command, shown = self.launcher(procs)
        entry = {"processes": procs, "grad_accumulation": accumulation, "stop_at_step": stop,
                 "command": " ".join(shown + argv)}
        record["legs"].append(entry)
        print(f"{name}/{run}: {entry['command']}", flush=True)
        start = time.monotonic()
        returncode, tail = self.execute(command + argv, f"{name}/{run}", timeout=max(10.0, self.remaining()))
        entry |= {"returncode": returncode, "wall_s": round(time.monotonic() - start, 1)}
        record["returncode"] = returncode
        record |= read_metrics(run_dir / "04_train")
        if returncode != 0:
            entry["error_tail"] = tail
            print(f"{name}/{run}: failed (exit {returncode}):\n{tail[-1500:]}", flush=True)
            return False
        if first:
            plan["estimate_s"] = max(plan.get("estimate_s", 0), entry["wall_s"])
        return True

    def finish_run(self, run: str, plan: dict, record: dict) -> None:
        train_dir = plan["folder"] / run / "04_train"
        manifest = train_dir / "manifest.json"
        if manifest.is_file():
            record["manifest_counts"] = json.loads(manifest.read_text())["counts"]
        else:
            record["unfinished"] = True  # a leg was skipped or failed: compared over the steps it reached
        shutil.rmtree(train_dir / "checkpoints", ignore_errors=True)  # a Kimi-shaped one is ~14 GB

    def launcher(self, procs: int) -> tuple[list[str], list[str]]:
        """The command that starts `procs` processes, and the same as a user types it."""
        if procs == 1:
            return [sys.executable], ["python"]
        self.port += 7  # a fresh port each launch: the last one may linger in TIME_WAIT
        if self.cuda:
            return ([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(procs),
                     "--num_machines", "1", "--dynamo_backend", "no", "--main_process_port", str(self.port)],
                    ["accelerate", "launch", "--multi_gpu", "--num_processes", str(procs)])
        return ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)],
                ["torchrun", "--standalone", "--nproc_per_node", str(procs)])

    def execute(self, command: list[str], label: str, timeout: float) -> tuple[int, str]:
        """Run in its own process group (killed whole at the deadline); output appended to the log."""
        with open(self.log_path, "a") as log:
            log.write(f"\n===== {label}: {' '.join(command)}\n")
            log.flush()
            process = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, start_new_session=True)
            killed = threading.Event()
            timer = threading.Timer(min(timeout, 7 * 86400),
                                    lambda: (killed.set(), os.killpg(process.pid, signal.SIGKILL)))
            timer.start()
            lines = []
            try:
                for line in iter(process.stdout.readline, ""):
                    for part in line.replace("\r", "\n").splitlines():
                        if part.strip() and "it/s" not in part and "s/it" not in part:  # not the progress bar
                            log.write(part + "\n")
                            lines.append(part)
                returncode = process.wait()
            finally:
                timer.cancel()
            if killed.is_set():
                lines.append(f"killed at the deadline ({timeout:.0f} s)")
                log.write(lines[-1] + "\n")
        return returncode, "\n".join(lines[-60:])


# ------------------------------------------------------------------------------------------ inputs
def write_target(folder: Path, shape: dict, device: torch.device) -> None:
    """A target folder with only embed_tokens, the final norm and (untied) lm_head, random, real names."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    gen = torch.Generator(device).manual_seed(0)
    vocab, hidden, prefix = shape["vocab"], shape["hidden"], shape["prefix"]

    def weights(*size: int, scale: float = 0.02, mean: float = 0.0) -> torch.Tensor:
        return (mean + scale * torch.randn(*size, generator=gen, device=device)).to(torch.bfloat16).cpu()

    tensors = {f"{prefix}model.embed_tokens.weight": weights(vocab, hidden),
               f"{prefix}model.norm.weight": weights(hidden, scale=0.1, mean=1.0)}
    if not shape["tied"]:
        tensors[f"{prefix}lm_head.weight"] = weights(vocab, hidden)
    save_file(tensors, str(folder / "model.safetensors"))
    text = {"hidden_size": hidden, "vocab_size": vocab, "rms_norm_eps": 1e-6 if prefix else 1e-5,
            "num_hidden_layers": max(shape["aux_layer_ids"]) + 3,  # the aux ids are the default (2, L//2, L-3)
            "tie_word_embeddings": shape["tied"]}
    config = {"model_type": "kimi_k25", "text_config": text} if prefix else {"model_type": "llama", **text}
    save(folder / "config.json", config, indent=1)


def fabricate_inputs(config, shape: dict, device: torch.device) -> dict:
    """Finished 01_data, 02_hidden_states (random bf16 states) and 03_vocab (the real stage) under `config`."""
    from eagle3_pipeline import vocab
    from eagle3_pipeline.capture.store import SampleStates
    from eagle3_pipeline.pack_plan import training_rows
    from eagle3_pipeline.stand_ins.fabricated_stages import write_data_stage, write_states_stage

    rng = np.random.default_rng(0)
    low, high = shape["lengths"]
    samples = {}
    for split, count in (("train", shape["train_samples"]), ("eval", shape["eval_samples"])):
        samples[split] = []
        for i in range(count):
            length = int(rng.integers(low, high + 1))
            prompt = int(rng.integers(2, length // 3))
            ids = (rng.zipf(1.3, length) % shape["vocab"]).tolist()  # a skewed token distribution
            samples[split].append({"id": f"{split}-{i:05d}", "input_ids": ids,
                                   "loss_mask": [0] * prompt + [1] * (length - prompt)})
    write_data_stage(config, samples["train"], samples["eval"], shape["vocab"])
    gen = torch.Generator(device).manual_seed(1)
    every = samples["train"] + samples["eval"]
    num_aux, hidden = len(shape["aux_layer_ids"]), shape["hidden"]

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).to(torch.bfloat16).cpu()

    states = [SampleStates(s["id"], randn(len(s["input_ids"]), num_aux, hidden), randn(len(s["input_ids"]), hidden))
              for s in every]
    write_states_stage(config, states, shape["aux_layer_ids"])
    vocab.run(config)
    rows = sum(training_rows(len(s["input_ids"])) for s in samples["train"])
    return {"train_samples": len(samples["train"]), "eval_samples": len(samples["eval"]), "train_rows": rows,
            "states_gib": round(sum(len(s["input_ids"]) for s in every) * (num_aux + 1) * hidden * 2 / 2**30, 2)}


# ------------------------------------------------------------------------------------------ analysis
def read_metrics(train_dir: Path) -> dict:
    path = train_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {split: [r for r in records if r["split"] == split] for split in ("train", "eval")}


def compare(want: list[dict], got: list[dict], first_step: int = 1) -> dict:
    """Largest differences per metric over the steps both hold from `first_step` on."""
    want_by = {r["step"]: r for r in want if r["step"] >= first_step}
    got_by = {r["step"]: r for r in got if r["step"] >= first_step}
    steps = sorted(want_by.keys() & got_by.keys())
    out = {"steps": [steps[0], steps[-1]] if steps else [], "missing_steps": sorted(want_by.keys() - got_by.keys())}
    if not steps:
        return out
    keys = [k for k in want_by[steps[0]] if k.startswith(("loss_", "acc_"))] + \
        [k for k in ("lr", "grad_norm") if k in want_by[steps[0]]]
    for key in keys:
        a = np.array([want_by[s][key] for s in steps])
        diff = np.abs(a - np.array([got_by[s][key] for s in steps]))
        out[key] = {"max_abs": float(diff.max()), "max_rel": float((diff / np.maximum(np.abs(a), 1e-12)).max()),
                    "at_step": int(steps[int(diff.argmax())])}
    losses = [k for k in keys if k.startswith("loss_")]
    out["max_rel_loss"] = max(out[k]["max_rel"] for k in losses)
    out["max_abs_acc"] = max(out[k]["max_abs"] for k in keys if k.startswith("acc_"))
    out["bitwise_equal_loss"] = all(out[k]["max_abs"] == 0 for k in losses)
    return out


def throughput(run: dict, measure_from: int, skip: set[int]) -> dict | None:
    rows = [r for r in run["train"] if r["step"] >= measure_from and r["step"] not in skip]
    if not rows:
        return None
    tokens = statistics.median(r["tokens_per_s"] for r in rows)
    out = {"tokens_per_s": tokens, "tokens_per_s_per_gpu": tokens / run["processes"], "steps_measured": len(rows)}
    if "mfu" in rows[0]:
        out["mfu"] = statistics.median(r["mfu"] for r in rows)
    if run.get("from_reference"):
        out["from_reference"] = True
    return out


def against_one(name: str, run: dict, done: dict, tolerance: float) -> dict:
    """A run's curves against the 1-process run's (a chain's also against the uninterrupted P-process run's)."""
    one = done["one"]
    entry = {"train": compare(one["train"], run["train"]), "eval": compare(one["eval"], run["eval"])}
    if len(run.get("legs", [None])) > 1 and f"multi_{run['processes']}" in done:
        entry["train_vs_multi"] = compare(done[f"multi_{run['processes']}"]["train"], run["train"])
    if run.get("from_reference") != one.get("from_reference"):
        entry["note"] = "the two runs were made in different leases (machines), the same code and inputs"
    entry["within_tolerance"] = bool(entry["train"].get("max_rel_loss", math.inf) <= tolerance)
    entry["all_steps_compared"] = not entry["train"]["missing_steps"]
    if name == "one_half":
        entry["control"] = "another global batch: a real difference, expected outside the tolerance"
    return entry


def summarize(runs: dict, shape: dict, precision: str, processes: list[int]) -> dict:
    """Every finished run against one, the throughput of the runs without a resume, the scaling efficiency."""
    tolerance = TOLERANCE[precision]
    done = {name: run for name, run in runs.items() if run.get("returncode") == 0}
    # the step after a checkpoint (config_tree: every resume_at steps) also times its save: not a training step's
    skip = {step + 1 for step in range(shape["resume_at"], shape["steps"], shape["resume_at"])}
    speeds = {name: throughput(run, shape["measure_from"], skip) for name, run in done.items()
              if len(run.get("legs", [None])) == 1 and name != "one_half"}
    comparisons = {f"{name}_vs_one": against_one(name, run, done, tolerance) for name, run in done.items()
                   if "one" in done and name != "one"}
    scaling, base = {}, speeds.get("one")
    for p in processes:
        multi = speeds.get(f"multi_{p}")
        if base and multi:
            scaling[str(p)] = {"tokens_per_s_per_gpu_1": base["tokens_per_s_per_gpu"],
                               "tokens_per_s_per_gpu": multi["tokens_per_s_per_gpu"],
                               "tokens_per_s": multi["tokens_per_s"],
                               "efficiency": multi["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]}
    return {"comparisons": comparisons, "throughput": speeds, "scaling": scaling, "tolerance_rel_loss": tolerance}


def print_summary(result: dict) -> None:
    for name, entry in result["shapes"].items():
        print(f"\n== {name} ({result['device']})")
        for label, c in entry.get("comparisons", {}).items():
            train = c["train"]
            print(f"  {label:<22} loss max rel diff {train.get('max_rel_loss', float('nan')):.2e}, acc max abs diff "
                  f"{train.get('max_abs_acc', float('nan')):.2e} over steps {train['steps']}; "
                  f"{'within' if c['within_tolerance'] else 'OUTSIDE'} tolerance {entry['tolerance_rel_loss']:g}"
                  f"{' (control: expected outside)' if 'control' in c else ''}")
        for label, s in entry.get("throughput", {}).items():
            if s:
                mfu = f", MFU {s['mfu']:.1%}" if "mfu" in s else ""
                print(f"  {label:<22} {s['tokens_per_s']:>10.0f} tokens/s, {s['tokens_per_s_per_gpu']:>10.0f} per GPU{mfu}")
        for p, s in entry.get("scaling", {}).items():
            print(f"  scaling 1 -> {p} GPUs: efficiency {s['efficiency']:.1%}")
        for label, run in entry.get("runs", {}).items():
            if run.get("skipped") or run.get("returncode"):
                print(f"  {label}: {run.get('skipped') or 'failed, exit ' + str(run['returncode'])}")
            elif run.get("from_reference"):
                print(f"  {label}: from --reference")


# ------------------------------------------------------------------------------------------ context
def device_name(cuda: bool) -> str:
    return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name()}" if cuda else "cpu"


def topology() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None


if __name__ == "__main__":
    main()
