"""Stream mode against offline on the same machine and data, in one run: training tokens/s, wall time, and
the share of its time each side waited for the other.

Shared 01 and 03 (real HumanEval chats on the demo target, SmolLM2-135M-Instruct), then runs of 02 + 04:

    offline   02 writes every sample's states, then 04 trains on them
    stream    02 and 04 started together (capture.mode stream), once per `--window-gb` given

Per run: 04's tokens/s (median over its logged steps), the share of its steps' time (the first, start-up,
left out) spent waiting for data (`data_wait_frac` weighted by `interval_s`, from metrics.jsonl), 02's time
waiting for room in the window (stream: its manifest), the wall time of each stage and of the whole run, the
engine calls 02 took for its packs, and the most stream bytes seen on disk. 04 reads its data as the config
says (`train.num_workers`: configs/demo.yaml 0, in the training process; configs/demo_gpu.yaml 2 loader workers).

    python -m bench.stream                          # writes bench/results/stream.json and stream.md
    python -m bench.stream --samples 32 --steps 16  # smaller
    python -m bench.stream --config configs/demo_gpu.yaml --prepared RUN --set KEY=VALUE ... --window-gb 0.4 2
                                                    # on a GPU: another config, RUN's 01_data and 03_vocab,
                                                    # a stream run per window
    python -m bench.stream ... --window-gb 0.4 --ahead-gb 0 0.4   # a stream run per window and capture.stream.ahead_gb
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.harness import RESULTS, ROOT, parser, save, stage_cmd


def start(script: str, config: Path, run_dir: Path, args, window_gb: float | None, log: Path,
          ahead_gb: float = 0.0) -> subprocess.Popen:
    """A stage script started with the bench's settings (stream mode within `window_gb` and capturing up to
    `ahead_gb` past its room, or offline: None), its output in `log`."""
    sets = [f"run_dir={run_dir}", f"train.max_steps={args.steps}", f"train.packed_length={args.packed_length}",
            "train.log_every=1", f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}", *args.set]
    sets += ["capture.mode=stream", f"capture.stream.window_gb={window_gb}",
             f"capture.stream.ahead_gb={ahead_gb}"] if window_gb is not None else []
    return subprocess.Popen(stage_cmd(script, config, sets), cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait(job: subprocess.Popen, log: Path) -> float:
    """Seconds from now until the job ends; a failed job stops the benchmark with its log's tail."""
    started = time.perf_counter()
    if job.wait() != 0:
        sys.exit(f"{job.args[1]} failed (exit {job.returncode}); see {log}:\n{log.read_text()[-3000:]}")
    return time.perf_counter() - started


def sample_bytes(folder: Path, stop: threading.Event, peak: list[int]) -> None:
    """The most bytes of stream packs in `folder` at once, looked at 5 times a second until `stop`."""
    while not stop.is_set():
        sizes = []
        for entry in os.scandir(folder) if folder.is_dir() else ():
            try:
                sizes.append(entry.stat().st_size if "pack_" in entry.name else 0)
            except FileNotFoundError:
                pass
        peak[0] = max(peak[0], sum(sizes))
        time.sleep(0.2)


def training_figures(run_dir: Path) -> dict:
    lines = (run_dir / "04_train" / "metrics.jsonl").read_text().splitlines()
    train = [r for r in map(json.loads, lines) if r["split"] == "train"][1:]  # the first step includes start-up
    manifest = json.loads((run_dir / "04_train" / "manifest.json").read_text())
    seconds = sum(r["interval_s"] for r in train)
    return {"tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in train),
            # of the steps' time, not a mean of per-step fractions: a long wait weighs what it lasts
            "data_wait_share": sum(r["data_wait_frac"] * r["interval_s"] for r in train) / seconds,
            "steps_s": round(seconds, 1),
            "train_tokens": manifest["counts"]["train_tokens_this_launch"],
            "losses": [round(r["loss_0"], 6) for r in train]}


def run_mode(window_gb: float | None, prepared: Path, config: Path, args, ahead_gb: float = 0.0) -> dict:
    """02 and 04 offline (`window_gb` None), or streaming within `window_gb`, 02 capturing up to `ahead_gb` past
    its room."""
    stream = window_gb is not None
    mode = (f"stream-{window_gb:g}gb" + (f"-ahead-{ahead_gb:g}gb" if ahead_gb else "")) if stream else "offline"
    run_dir = prepared.parent / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    for stage in ("01_data", "03_vocab"):
        shutil.copytree(prepared / stage, run_dir / stage)
    logs = {name: prepared.parent / f"{mode}-{name}.log" for name in ("02", "04")}
    stop, peak = threading.Event(), [0]
    sampler = threading.Thread(target=sample_bytes, args=(run_dir / "02_hidden_states" / "stream", stop, peak))
    sampler.start()
    started = time.perf_counter()
    capture = start("02_generate_hidden_states.py", config, run_dir, args, window_gb, logs["02"], ahead_gb)
    if stream:
        train_s = wait(start("04_train.py", config, run_dir, args, window_gb, logs["04"], ahead_gb), logs["04"])
        capture_s = train_s + wait(capture, logs["02"])
    else:
        capture_s = wait(capture, logs["02"])
        train_s = wait(start("04_train.py", config, run_dir, args, window_gb, logs["04"]), logs["04"])
    wall = time.perf_counter() - started
    stop.set()
    sampler.join()
    counts = json.loads((run_dir / "02_hidden_states" / "manifest.json").read_text())["counts"]
    result = {"mode": mode, "wall_s": round(wall, 1), "capture_stage_s": round(capture_s, 1),
              "train_stage_s": round(train_s, 1), **training_figures(run_dir)}
    if not stream:
        return result | {"bytes_on_disk": counts["bytes_on_disk"]}
    return result | {"capture_waited_s": counts["stream"]["waited_s"],
                     "capture_batches": counts["stream"].get("batches"),
                     "capture_wait_frac": counts["stream"]["waited_s"] / capture_s,
                     "streamed_bytes": counts["stream"]["bytes"], "most_held_bytes": peak[0],
                     "window_bytes": int(window_gb * 1e9), "ahead_bytes": int(ahead_gb * 1e9)}


def prepare(work: Path, config_path: Path, args) -> Path:
    """01 from HumanEval chats (real answers, assistant-only loss) and 03, as the tests fabricate them; or those
    of the run `args.prepared`."""
    prepared = work / "prepared"
    shutil.rmtree(prepared, ignore_errors=True)
    if args.prepared:
        for stage in ("01_data", "03_vocab"):
            shutil.copytree(args.prepared / stage, prepared / stage)
        return prepared
    from eagle3_pipeline import vocab
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.stand_ins import ensure_stand_in
    from eagle3_pipeline.stand_ins.fabricated_stages import humaneval_samples, write_data_stage

    config = load_config(config_path, [f"run_dir={prepared}"])
    samples = humaneval_samples(ensure_stand_in("smollm2-135m-instruct"), args.samples + 2, args.max_tokens)
    write_data_stage(config, samples[:-2], samples[-2:], vocab=49152)
    vocab.run(config)
    return prepared


def report(results: list[dict], args) -> str:
    """The table: offline first, then a column per stream run."""
    offline, streams = results[0], results[1:]

    def row(label: str, offline_cell: str, stream_cell) -> str:
        return f"| {label} | {offline_cell} | " + " | ".join(stream_cell(r) for r in streams) + " |"

    rows = [
        row("04 training tokens/s (median)", f"{offline['tokens_per_s_median']:,.0f}",
            lambda r: f"{r['tokens_per_s_median']:,.0f}"),
        row("04 steps 2-N wall s", f"{offline['steps_s']}", lambda r: f"{r['steps_s']}"),
        row("04 time waiting for data", f"{offline['data_wait_share']:.1%}", lambda r: f"{r['data_wait_share']:.1%}"),
        row("02 time waiting for room", "-", lambda r: f"{r['capture_wait_frac']:.1%}"),
        row("02 engine calls for the packs", "-", lambda r: f"{r.get('capture_batches') or '-'}"),
        *(row(f"{label} wall s", f"{offline[key]}", lambda r, key=key: f"{r[key]}") for label, key in (
            ("02 stage", "capture_stage_s"), ("04 stage", "train_stage_s"), ("02 + 04", "wall_s"))),
        row("states on disk, most", f"{offline['bytes_on_disk'] / 1e6:.1f} MB",
            lambda r: f"{r['most_held_bytes'] / 1e6:.1f} MB (window {r['window_bytes'] / 1e6:.0f} MB)"),
    ]
    if any(r.get("ahead_bytes") for r in streams):
        rows.append(row("02 may capture ahead, in host memory", "-",
                        lambda r: f"{r.get('ahead_bytes', 0) / 1e6:.0f} MB"))
    differences = [abs(a - b) for r in streams for a, b in zip(offline["losses"], r["losses"])]
    same = all(r["losses"] == offline["losses"] for r in streams)
    data = f"01 and 03 of {args.prepared}" if args.prepared else f"{args.samples} HumanEval chats (<= {args.max_tokens} tokens)"
    lines = [f"{data}, {args.config}, packed {args.packed_length}, {args.steps} steps; per-step losses equal: {same} "
             f"(largest difference {max(differences, default=None)})", "",
             "| | offline | " + " | ".join("stream" for _ in streams) + " |",
             "|---|---|" + "---|" * len(streams), *rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--samples", type=int, default=48)
    arguments.add_argument("--max-tokens", type=int, default=320, help="tokens per sample at most")
    arguments.add_argument("--packed-length", type=int, default=1024)
    arguments.add_argument("--steps", type=int, default=24)
    arguments.add_argument("--window-gb", type=float, nargs="+", default=[0.02],
                           help="a stream run within each of these windows (0.02: about 4 packs of 1024 rows)")
    arguments.add_argument("--ahead-gb", type=float, nargs="+", default=[0.0],
                           help="a stream run per window and each of these capture.stream.ahead_gb")
    arguments.add_argument("--work", type=Path, default=Path("/tmp/eagle3_bench_stream"))
    arguments.add_argument("--out", type=Path, default=RESULTS / "stream.json")
    arguments.add_argument("--config", type=Path, default=ROOT / "configs" / "demo.yaml")
    arguments.add_argument("--set", action="append", default=[], help="config override KEY=VALUE for 02 and 04 "
                           "(repeatable)")
    arguments.add_argument("--prepared", type=Path, default=None, help="a run whose 01_data and 03_vocab to use")
    args = arguments.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    config = args.work / args.config.name
    shutil.copy(args.config, config)
    prepared = prepare(args.work, config, args)
    results = []
    for window_gb, ahead_gb in [(None, 0.0), *((w, a) for w in args.window_gb for a in args.ahead_gb)]:
        results.append(run_mode(window_gb, prepared, config, args, ahead_gb))
        # after every run, so that a run cut short keeps what it measured
        save(args.out, {"settings": vars(args) | {"work": str(args.work), "out": str(args.out)},
                        "load_average_1min_at_end": os.getloadavg()[0], "runs": results})
    table = report(results, args)
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
