"""What 02's capture costs against plain prefill: the same samples, batches and engine settings, one engine at a time.

    python -m bench.capture_overhead --config configs/demo_gpu.yaml --set run_dir=RUN [--method worker_extension]
        [--max-samples 2000] [--repeat 1] --out capture_overhead.json

Reads RUN/01_data (01 must have run); `--repeat K` takes its training samples K times over, for full batches from
a small 01 (every engine runs with prefix caching off, so a repeat is prefilled in full). Each engine prefills the
samples in batches of `capture.batch_size`, one generated token each, as 02 does:
    plain, capturer's settings   the capture path's engine settings (prefix caching off; the worker extension
                                 also runs eager), nothing captured
    plain, config's settings     the run's engine settings with prefix caching off (CUDA graphs and compile as
                                 configured), where they differ from the capturer's
    capture                      02's capturer (capture/engine.py): states in the main process, as 02 receives
                                 them before it writes shards, each batch read while the next is prefilled
    capture, serial              the same capturer, each batch read before the next starts: its prefills alone,
                                 with nothing read beside them
Tokens/s per engine (wall clock of the batches, engine start excluded), each capture's time over each plain one,
and where a capture's time went in its timed batches (`parts_s`: prefills; reading the states, and the part of it
no prefill hid; for the worker extension the worker's own account: `worker_steps`, host seconds recording steps and
handing rounds over, and on a GPU the device seconds of the forwards and of the copies out, from CUDA events).

`--profile DIR`: after each engine's timed run, vLLM's torch profiler over `--profile-batches` more batches
(the engine's worker: host and device), one trace per engine in DIR/<engine>/, summarised into the result: the
worker's host time by operator (inclusive: a step's annotation holds its operators) and by CUDA runtime call, and
the device time by kernel (the overlapped capture only).
"""

from __future__ import annotations

import collections
import gc
import gzip
import json
import re
import time
from pathlib import Path

from bench.harness import parser, save
from eagle3_pipeline.capture.engine import CaptureSeconds
from eagle3_pipeline.capture.stage import load_samples
from eagle3_pipeline.config import load_config
from eagle3_pipeline.target import run_aux_layer_ids, target_path, text_config


def batches_of(samples, batch_size: int) -> list[list]:
    return [[(s.input_ids, list(s.images)) for s in samples[start : start + batch_size]]
            for start in range(0, len(samples), batch_size)]


def chosen_samples(samples: list, max_samples: int, repeat: int) -> list:
    return (samples * repeat)[:max_samples]


def timed_batches(samples, batch_size: int, run_batch, run_batches=None, warmed_up=None) -> float:
    """Seconds to run every batch (`run_batches(batches)` at once, or `run_batch` on each), after one unmeasured
    batch (the warm-up), then `warmed_up()` where given."""
    batches = batches_of(samples, batch_size)
    run_batch(batches[0])
    if warmed_up is not None:
        warmed_up()
    started = time.perf_counter()
    if run_batches is None:
        for batch in batches:
            run_batch(batch)
    else:
        run_batches(batches)
    return time.perf_counter() - started


def shut_down(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def plain_engines(config, capturer_settings: dict) -> dict[str, dict]:
    """The plain engines to measure: the capturer's settings, and the config's where they differ."""
    configured_eager = config.target.engine.enforce_eager
    engines = {"plain, capturer's settings": capturer_settings}
    if capturer_settings.get("enforce_eager", configured_eager) != configured_eager:
        engines["plain, config's settings"] = {"enable_prefix_caching": False}
    return engines


def profiler_settings(profile: Path | None, engine: str) -> dict:
    """vLLM keywords for a torch profiler writing its trace into profile/<engine> (none without `profile`)."""
    if profile is None:
        return {}
    folder = profile / re.sub(r"[^a-z0-9]+", "_", engine.lower()).strip("_")
    return {"profiler_config": {"profiler": "torch", "torch_profiler_dir": str(folder),
                                "torch_profiler_with_stack": False}}


def profiled(llm, samples, batch_size: int, run_batch, count: int, folder: str) -> dict:
    """`count` more batches under the engine's profiler (`profiler_settings`), and what its trace says."""
    llm.start_profile()
    for batch in batches_of(samples, batch_size)[:count]:
        run_batch(batch)
    llm.stop_profile()
    return trace_summary(max(Path(folder).rglob("*.json*"), key=lambda path: path.stat().st_mtime))


STEP_MARK = re.compile(r"execute_context_(\d+)\((\d+)\)")


def trace_summary(trace: Path, top: int = 12) -> dict:
    """A chrome trace of torch's profiler summed by name: the host's operators (time inclusive of what they
    call), its CUDA runtime calls and the device's kernels and copies, each with its count; the wall span; and
    the engine steps that prefilled tokens, in order (requests, tokens, host ms)."""
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as file:
        events = [e for e in json.load(file)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    kinds = {"host operators": ("cpu_op", "user_annotation"), "CUDA runtime": ("cuda_runtime", "cuda_driver"),
             "device": ("kernel", "gpu_memcpy", "gpu_memset")}
    result = {"trace": str(trace), "span_ms": (max(e["ts"] + e["dur"] for e in events)
                                               - min(e["ts"] for e in events)) / 1e3 if events else 0.0}
    # vLLM's worker marks each step `execute_context_<prefill requests>(<their tokens>)_generation_...`: how the
    # engine split a batch into steps
    marked = sorted(((e, mark) for e in events if (mark := STEP_MARK.match(e["name"]))), key=lambda m: m[0]["ts"])
    result["steps"] = [{"prefill_requests": int(mark[1]), "prefill_tokens": int(mark[2]),
                        "ms": round(e["dur"] / 1e3, 2)} for e, mark in marked if int(mark[2])]
    for kind, categories in kinds.items():
        totals, counts = collections.Counter(), collections.Counter()
        for event in events:
            if event.get("cat") in categories:
                totals[event["name"]] += event["dur"] / 1e3
                counts[event["name"]] += 1
        result[kind] = {"total_ms": round(sum(totals.values()), 2),
                        "top": [{"name": name[:100], "ms": round(ms, 2), "count": counts[name]}
                                for name, ms in totals.most_common(top)]}
    return result


def summary(args, overrides: list[str], samples: list, tokens: int, batch_size: int, rows: dict) -> dict:
    return {"config": args.config, "overrides": overrides, "samples": len(samples), "repeat": args.repeat,
            "tokens": tokens, "batch_size": batch_size, "engines": rows,
            "capture_over_plain": {capture: {name: rows[capture]["seconds"] / row["seconds"]
                                             for name, row in rows.items() if name.startswith("plain")}
                                   for capture in rows if capture.startswith("capture")}}


def measured_row(llm, samples, batch_size: int, tokens: int, run_batch, args, profiling: dict, run_batches=None,
                 capturer=None):
    """Seconds and tokens/s of every batch after a warm-up, for a `capturer` where those batches' time went, and the
    profile of a few more where asked."""
    counted_from_here = None if capturer is None else (lambda: setattr(capturer, "seconds", CaptureSeconds()))
    seconds = timed_batches(samples, batch_size, run_batch, run_batches, counted_from_here)
    row = {"seconds": round(seconds, 2), "tokens_per_s": tokens / seconds}
    if capturer is not None:
        row["parts_s"] = capturer.seconds.record()
    if profiling:
        row["profile"] = profiled(llm, samples, batch_size, run_batch, args.profile_batches,
                                  profiling["profiler_config"]["torch_profiler_dir"])
    return row


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--config", required=True)
    arguments.add_argument("--set", action="append", default=[], help="config override KEY=VALUE (repeatable)")
    arguments.add_argument("--method", default=None, help="capture.method to measure (default: the config's)")
    arguments.add_argument("--max-samples", type=int, default=2000)
    arguments.add_argument("--repeat", type=int, default=1, help="take 01's training samples this many times over")
    arguments.add_argument("--out", type=Path, required=True)
    arguments.add_argument("--profile", type=Path, metavar="DIR",
                           help="also profile each engine (vLLM's torch profiler)")
    arguments.add_argument("--profile-batches", type=int, default=2)
    args = arguments.parse_args()

    from eagle3_pipeline.capture.engine import (
        ExtractHiddenStatesCapturer,
        WorkerExtensionCapturer,
        _prompts,
        choose_method,
        open_capturer,
    )
    from eagle3_pipeline.data.vision import Vision
    from eagle3_pipeline.engine import start_engine

    overrides = args.set + ([f"capture.method={args.method}"] if args.method else [])
    config = load_config(args.config, overrides)
    model_dir = target_path(config.target)
    text = text_config(model_dir)
    method = choose_method(config.capture.method, text)
    train_samples = [s for s in load_samples(Path(config.run_dir) / "01_data") if s.split == "train"]
    samples = chosen_samples(train_samples, args.max_samples, args.repeat)
    tokens, batch_size = sum(len(s.input_ids) for s in samples), config.capture.batch_size
    capturer_class = ExtractHiddenStatesCapturer if method == "extract_hidden_states" else WorkerExtensionCapturer
    text_only = not any(s.images for s in samples)  # as 02 starts its engine
    rows = {}
    for name, settings in plain_engines(config, capturer_class.ENGINE_SETTINGS).items():
        profiling = profiler_settings(args.profile, name)
        llm = start_engine(config.target, model_dir, text_only=text_only, **settings, **profiling)
        vision = None if text_only else Vision.of_engine(llm, model_dir)

        def run_batch(batch, llm=llm, vision=vision):
            llm.generate(*_prompts(batch, vision), use_tqdm=False)

        rows[name] = {"settings": {"enforce_eager": config.target.engine.enforce_eager} | settings,
                      **measured_row(llm, samples, batch_size, tokens, run_batch, args, profiling)}
        shut_down(llm)
    profiling = profiler_settings(args.profile, "capture")
    # the capturer starts its engine with its class's settings: the profiler joins them
    capturer_class.ENGINE_SETTINGS = {**capturer_class.ENGINE_SETTINGS, **profiling}
    capturer = open_capturer(config, model_dir, text, run_aux_layer_ids(config, text["num_hidden_layers"]), text_only)
    rows["capture"] = {"method": method, **measured_row(
        capturer.llm, samples, batch_size, tokens, capturer.capture, args, profiling,
        lambda batches: collections.deque(capturer.capture_batches(batches), maxlen=0), capturer)}
    rows["capture, serial"] = {"method": method, **measured_row(
        capturer.llm, samples, batch_size, tokens, capturer.capture, args, {}, capturer=capturer)}
    shut_down(capturer.llm)
    result = summary(args, overrides, samples, tokens, batch_size, rows)
    save(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
