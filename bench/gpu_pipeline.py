"""The pipeline on a GPU node, as a user runs it: each stand-in x capture path x model runner, stage by stage.

    python -m bench.gpu_pipeline --out /tmp/gpu_results [--only smollm2-extract,...] [--set SECTION.KEY=VALUE ...]

Runs every stage script as a subprocess (CUDA graphs on, bf16, compile: configs/demo_gpu.yaml for SmolLM2, the
tiny Kimi with GPU engine settings), records each stage's exit status and wall time, checks 02's states against
Hugging Face transformers' forward of the same target, and reads 06's report (verdict, acceptance, speed).
A run that only varies later stages (another runner) starts from a copy of another run's earlier stages. Then
the benches that need the GPU to themselves: capture against plain prefill (bench/capture_overhead.py) and stream
mode against offline (bench/stream.py). Writes <out>/gpu_pipeline.json after every stage, so a run cut short
keeps what it measured. `--set` adds overrides to every stage job (after the job's own), for example
`target.engine.enforce_eager=true` where a lease is too short for each engine's compile and CUDA graphs.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

# imported here, not in hf_check: two chains' checks importing transformers lazily at once can see it half-initialised
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

from bench.harness import MLA_HEADS, PY, cached, logged_call, parser, save, stage_cmd
from eagle3_pipeline.capture.store import open_reader
from eagle3_pipeline.config import load_config
from eagle3_pipeline.data.dataset import open_split
from eagle3_pipeline.stage_io import STAGES
from eagle3_pipeline.stand_ins.tiny_kimi import write_image_chat
from eagle3_pipeline.target import target_path
from patches import PLUGIN_NAME

SCRIPTS = {spec.name: spec.script for spec in STAGES.values()}
ALL = tuple(SCRIPTS)
# 02 against transformers (fp32 reference, same tokens): the relative error a capture dtype allows. bf16: the
# states are stored in bf16 (0.4% rounding) after many layers of bf16 kernels whose sums round otherwise than
# fp32's, so the bound is 3% or 1.5x transformers' own bf16 forward's error against its fp32 one on the same
# samples, whichever is larger (SmolLM2's bf16 forward is 0.2-1.8% off; the random tiny Kimi's, whose MoE routing
# flips under bf16 rounding, 3-6%); fp32: kernel order only.
TOLERANCE = {"bfloat16": 0.03, "float32": 0.005}
OWN_ERROR_MARGIN = 1.5
KIMI_GPU = ["target.engine.enforce_eager=false", "target.engine.cpu_reserved_cores=null", "train.mixed_precision=bf16",
            "train.compile=true"]
# Jobs that share the GPU at once: each engine takes a share of it with an explicit KV cache, so that one engine's
# start (vLLM measures its own peak against the device's free memory) is not upset by another's allocations
SHARE = ["target.engine.gpu_memory_utilization=0.2", "target.engine.kv_cache_memory_gb=4"]
# SmolLM2's engine beside a trainer (stream mode) or alone: the prepared run and the benches on it use the same
# engine settings, so that the benches' stages find the prepared 01 current
SMOL_SHARE = ["target.engine.gpu_memory_utilization=0.4", "target.engine.kv_cache_memory_gb=16"]
SMOL_SETS = [word for value in SMOL_SHARE for word in ("--set", value)]
# the tiny Kimi's data as tests/test_pipeline_tiny_kimi.py's: magpie chats in thinking mode and a two-image chat
KIMI_SOURCES = "data.sources=[{kind: magpie, limit: 32, max_tokens: 8}, {kind: file, name: $WORK/pictures.jsonl}]"
# an MLA draft (draft.attention mla) at the head dims vLLM's GPU MLA prefill backends take (qk_nope 128, rope 64,
# v 128) and the latent its decode kernels take (kv_lora 512); q_lora as the target's (Kimi) or 3x its heads (SmolLM2)
KIMI_MLA = [*SHARE, *MLA_HEADS, "draft.q_lora_rank=64"]


@dataclass
class Job:
    name: str
    config: str
    stages: tuple[str, ...] = ()
    overrides: list[str] = field(default_factory=list)
    environment: dict[str, str] = field(default_factory=dict)
    copy_from: str | None = None  # a job whose finished stages before the first of `stages` this one reuses
    bench: list[str] = field(default_factory=list)  # instead of stages: a bench script's arguments ($WORK, $OUT)


def capture_overhead(method: str) -> Job:
    return Job(f"capture-overhead-{method}", "configs/demo_gpu.yaml", bench=[
        "-m", "bench.capture_overhead", "--config", "configs/demo_gpu.yaml", "--set", "run_dir=$WORK/smollm2-prepare",
        *SMOL_SETS, "--method", method, "--max-samples", "1500", "--out", f"$OUT/capture_overhead_{method}.json"])


def stream_job(name: str, method: str, steps: int = 60, windows: tuple[str, ...] = ("0.4", "2"),
               ahead: tuple[str, ...] = ("0",)) -> Job:
    """Stream mode against offline at the GPU demo's shape, within 0.4 GB (10 packs) and the demo's 2 GB (52 of
    the 60 steps' packs: mostly the window's first fill), or as asked."""
    return Job(name, "configs/demo_gpu.yaml", bench=[
        "-m", "bench.stream", "--config", "configs/demo_gpu.yaml", "--prepared", "$WORK/smollm2-prepare", *SMOL_SETS,
        "--set", f"capture.method={method}", "--steps", str(steps), "--packed-length", "8192", "--window-gb", *windows,
        "--ahead-gb", *ahead, "--work", f"$WORK/{name}", "--out", f"$OUT/{name.replace('-', '_')}_gpu.json"])


# Phases run one after the other; the chains of a phase at once, the jobs of a chain in order.
PHASES = [
    # the tiny Kimi under both runners (the MRv2 job starts from the V1 job's 01_data once it exists), and the
    # SmolLM2 data the benches read
    [[Job("tiny-kimi-v1", "configs/tiny_kimi.yaml", ALL, [*SHARE, KIMI_SOURCES, *KIMI_GPU],
          {"VLLM_USE_V2_MODEL_RUNNER": "0"})],
     [Job("tiny-kimi-mrv2", "configs/tiny_kimi.yaml", ALL[1:], [*SHARE, KIMI_SOURCES, *KIMI_GPU],
          {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "tiny-kimi-v1")],
     [Job("smollm2-prepare", "configs/demo_gpu.yaml", ("01_data", "03_vocab"), SMOL_SHARE)]],
    # alone on the GPU: what capture costs against plain prefill; stream mode (02 and 04 at once) against offline
    [[capture_overhead("worker_extension"),
      stream_job("stream", "auto"),  # on a GPU auto takes the worker extension
      stream_job("stream-extract_hidden_states", "extract_hidden_states"),
      # 04's steady state in a 10-pack window (200 steps: 20 windows' worth), 02 capturing nothing, one and two
      # windows past its room (capture.stream.ahead_gb)
      stream_job("stream-ahead", "auto", steps=200, windows=("0.4",), ahead=("0", "0.4", "0.8")),
      capture_overhead("extract_hidden_states")]],
    # the GPU demo alone on the GPU, 01-06: the per-stage figures
    [[Job("smollm2-extract", "configs/demo_gpu.yaml", ALL, ["capture.method=extract_hidden_states"])]],
    # the learned tiny Kimi (a Kimi-architecture target a draft can learn from): built, then 01-06 under both
    # runners (the MRv2 job starts from the V1 job's 01_data)
    [[Job("learned-kimi-build", "configs/demo_kimi_gpu.yaml",
          bench=["-m", "eagle3_pipeline", "stand-ins", "tiny-kimi-k25-learned"]),
      Job("learned-kimi-v1", "configs/demo_kimi_gpu.yaml", ALL, SHARE, {"VLLM_USE_V2_MODEL_RUNNER": "0"})],
     [Job("learned-kimi-mrv2", "configs/demo_kimi_gpu.yaml", ALL[1:], SHARE, {"VLLM_USE_V2_MODEL_RUNNER": "1"},
          "learned-kimi-v1")],
     # the MLA draft on the same 01-03 (04-06; 06 once more under MRv2), and on SmolLM2 (a dense target), 01-06:
     # there 06 refuses the MLA draft before any load (exit 2; bench/results/mla_gpu.md)
     [Job("learned-kimi-mla", "configs/demo_kimi_gpu.yaml", ALL[3:], KIMI_MLA,
          {}, "learned-kimi-v1"),
      Job("learned-kimi-mla-mrv2", "configs/demo_kimi_gpu.yaml", ALL[5:], KIMI_MLA,
          {"VLLM_USE_V2_MODEL_RUNNER": "1"}, "learned-kimi-mla")],
     [Job("smollm2-mla", "configs/demo_gpu.yaml", ALL, [*SHARE, *MLA_HEADS, "draft.q_lora_rank=192"])],
     # 06 on the V1 job's export once more, target and draft in float16 (3 more mantissa bits than bf16; vLLM has
     # no float32 MLA kernel on a GPU), beside the V1 job's bf16 06: whether a greedy difference beyond the MoE
     # target's own bf16 batch variance stays (the draft's) or goes (rounding); 01's bf16 answers stay
     [Job("learned-kimi-fp16", "configs/demo_kimi_gpu.yaml", ALL[5:], [*SHARE, "validate.engine_dtype=float16"],
          {"VLLM_USE_V2_MODEL_RUNNER": "0"}, "learned-kimi-v1")]],
]
LOCK = threading.Lock()


def hf_check(config_path: str, overrides: list[str], run_dir: Path, samples: int = 8) -> dict:
    """Relative error of 02's aux states (each layer id) and of norm(final) against transformers' fp32 forward,
    beside that of transformers' own forward in the capture dtype."""
    config = load_config(config_path, [*overrides, f"run_dir={run_dir}"])
    model_dir = target_path(config.target)
    reader, layout = open_reader(run_dir / "02_hidden_states")
    split = open_split(run_dir / "01_data", "train")
    rows = [row for row in split if not row.get("images")][:samples]
    architecture = AutoConfig.from_pretrained(model_dir, trust_remote_code=config.target.trust_remote_code)
    loader = AutoModelForImageTextToText if hasattr(architecture, "text_config") else AutoModelForCausalLM
    dtypes = {"float32": torch.float32, config.capture.dtype: getattr(torch, config.capture.dtype)}
    text_models = {}
    for name, dtype in dtypes.items():
        model = loader.from_pretrained(model_dir, dtype=dtype).cuda().eval()
        text_models[name] = model.model.language_model if hasattr(architecture, "text_config") else model.model
    errors: dict[str, float] = {}
    own_errors: dict[str, float] = {}  # transformers in the capture dtype against transformers in fp32
    for row in rows:
        aux, final = reader.get(row["id"])
        ids = torch.tensor([row["input_ids"]]).cuda()
        with torch.no_grad():
            hidden = {name: m(input_ids=ids, output_hidden_states=True).hidden_states
                      for name, m in text_models.items()}
            expected = {f"id {i}": hidden["float32"][i][0] for i in layout.aux_layer_ids}
            expected["final"] = hidden["float32"][-1][0]
            captured = {f"id {i}": aux[:, j] for j, i in enumerate(layout.aux_layer_ids)}
            captured["final"] = text_models["float32"].norm(final.cuda().float())
            own = {f"id {i}": hidden[config.capture.dtype][i][0] for i in layout.aux_layer_ids}
            own["final"] = hidden[config.capture.dtype][-1][0]
            for name, reference in expected.items():
                reference = reference.float()
                for table, actual in ((errors, captured[name]), (own_errors, own[name])):
                    error = ((actual.cuda().float() - reference).norm() / reference.norm()).item()
                    table[name] = max(table.get(name, 0.0), error)
    base = TOLERANCE[config.capture.dtype]
    tolerance = {name: base if config.capture.dtype == "float32" else max(base, OWN_ERROR_MARGIN * own_errors[name])
                 for name in errors}
    return {"samples": len(rows), "dtype": config.capture.dtype, "max_relative_error": errors,
            "transformers_own_error": own_errors, "tolerance": tolerance,
            "passed": bool(rows) and all(errors[name] < tolerance[name] for name in errors)}


VALIDATE_KEYS = ("verdict", "problems", "mean_acceptance_length", "mean_request_acceptance_length",
                 "greedy_identical_fraction", "without_speculation", "speed")
VALIDATE_RUN_KEYS = ("num_speculative_tokens", "mean_acceptance_length", "mean_request_acceptance_length",
                     "simulated_mean_acceptance_length", "tokens_per_s", "speedup", "speed", "skipped_parameters",
                     "shared_from_target")


def run_logged_step(job: Job, command: list[str], log: Path, work: Path, out: Path) -> dict:
    """One command of a job with its environment, output in `log`: exit status, seconds, the command as a user
    types it and the log's tail."""
    rc, seconds = logged_call(command, log, {**os.environ, **job.environment})
    shown = " ".join([*(f"{k}={v}" for k, v in job.environment.items()), "python", *command[1:]])
    return {"exit": rc, "seconds": round(seconds, 1), "command": shown.replace(str(work), "$WORK").replace(str(out), "$OUT"),
            "tail": log.read_text(errors="replace").splitlines()[-6:]}


def save_results(out: Path, results: dict) -> None:
    with LOCK:
        save(out / "gpu_pipeline.json", results)


def copy_earlier_stages(job: Job, work: Path, results: dict) -> str | None:
    """The stages before the job's first from the job it starts from, once that job has them; why not, if not."""
    for name in ALL[: ALL.index(job.stages[0])]:
        while not (work / job.copy_from / name / "manifest.json").exists():  # another chain makes it
            if any(stage["exit"] != 0 for stage in results.get(job.copy_from, {}).get("stages", {}).values()):
                return f"{job.copy_from} failed before its {name}"
            time.sleep(5)
        shutil.copytree(work / job.copy_from / name, work / job.name / name, dirs_exist_ok=True)
    return None


def run_job(job: Job, out: Path, work: Path, results: dict) -> None:
    if job.bench:
        command = [PY, *(arg.replace("$WORK", str(work)).replace("$OUT", str(out)) for arg in job.bench)]
        results[job.name] = run_logged_step(job, command, out / f"{job.name}.log", work, out)
        return save_results(out, results)
    run_dir = work / job.name
    record = results[job.name] = {"config": job.config, "overrides": job.overrides, "environment": job.environment,
                                  "stages": {}}
    if job.copy_from and (reason := copy_earlier_stages(job, work, results)):
        record["skipped"] = reason
        return
    overrides = [override.replace("$WORK", str(work)) for override in job.overrides]
    for name in job.stages:
        command = stage_cmd(SCRIPTS[name], job.config, [*overrides, f"run_dir={run_dir}"])
        stage = record["stages"][name] = run_logged_step(job, command, out / f"{job.name}-{name}.log", work, out)
        if name == "02_hidden_states" and stage["exit"] == 0:
            try:
                record["hf_check"] = hf_check(job.config, overrides, run_dir)
            except Exception as err:  # noqa: BLE001 - recorded as the check's result
                record["hf_check"] = {"passed": False, "error": repr(err)[:500]}
        if name == "06_validate":
            report = cached(run_dir / name / "report.json") or {}
            record["validate"] = {key: report.get(key) for key in VALIDATE_KEYS}
            record["validate"]["runs"] = [{k: r.get(k) for k in VALIDATE_RUN_KEYS} for r in report.get("runs", [])]
        for manifest in (run_dir / name).glob("manifest.json"):
            stage["manifest"] = {k: v for k, v in json.loads(manifest.read_text()).items()
                                 if k in ("counts", "timings_s", "extra", "versions")}
        save_results(out, results)
        if stage["exit"] != 0:
            break


def plugin_installed() -> bool:
    return any(entry.name == PLUGIN_NAME for entry in importlib.metadata.entry_points(group="vllm.general_plugins"))


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--out", type=Path, required=True)
    arguments.add_argument("--work", type=Path, default=Path("/tmp/gpu_runs"))
    arguments.add_argument("--only", default="", help="comma-separated job names (default: all, in order)")
    arguments.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                           help="an override for every stage job, after its own (repeatable)")
    args = arguments.parse_args()
    if not plugin_installed():  # else every job would build or prepare for minutes and then stop at 02
        sys.exit(f"error: the entry point {PLUGIN_NAME!r} is not installed here: install the project "
                 "(pip install --no-deps --no-build-isolation -e .) before running the stages")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    write_image_chat(args.work)
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}

    def run_chain(chain: list[Job]) -> None:
        for job in chain:
            if not args.only or job.name in args.only.split(","):
                run_job(job if job.bench else replace(job, overrides=[*job.overrides, *args.overrides]), args.out,
                        args.work, results)

    for phase in PHASES:
        threads = [threading.Thread(target=run_chain, args=(chain,)) for chain in phase]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()


if __name__ == "__main__":
    main()
