"""What 02's capture costs against plain prefill: the same samples, batches and engine settings, one engine at a time.

    python -m bench.capture_overhead --config configs/demo_gpu.yaml --set run_dir=RUN [--method worker_extension]
        [--max-samples 2000] --out capture_overhead.json

Reads RUN/01_data (01 must have run). Each engine prefills the samples in batches of `capture.batch_size`, one
generated token each, as 02 does:
    plain, capturer's settings   the capture path's engine settings (prefix caching off; the worker extension
                                 also runs eager), nothing captured
    plain, config's settings     the run's engine settings with prefix caching off (CUDA graphs and compile as
                                 configured), where they differ from the capturer's
    capture                      02's capturer (capture/engine.py): states in the main process, as 02 receives
                                 them before it writes shards, each batch read while the next is prefilled
Tokens/s per engine (wall clock of the batches, engine start excluded), capture's time over each plain one, and
where the capture's time went (prefills; reading the states, and the part of it no prefill hid; for the worker
extension the worker's own account: `worker_steps`, host seconds recording steps and handing rounds over, and on
a GPU the device seconds of the forwards and of the copies out, from CUDA events).
"""

from __future__ import annotations

import collections
import gc
import json
import time
from pathlib import Path

from bench.harness import parser, save
from eagle3_pipeline.capture.stage import load_samples
from eagle3_pipeline.config import load_config
from eagle3_pipeline.target import run_aux_layer_ids, target_path, text_config


def timed_batches(samples, batch_size: int, run_batch, run_batches=None) -> float:
    """Seconds to run every batch (`run_batches(batches)` at once, or `run_batch` on each), after one unmeasured
    batch (the warm-up)."""
    batches = [[(s.input_ids, list(s.images)) for s in samples[start : start + batch_size]]
               for start in range(0, len(samples), batch_size)]
    run_batch(batches[0])
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


def summary(args, overrides: list[str], samples: list, tokens: int, batch_size: int, rows: dict) -> dict:
    return {"config": args.config, "overrides": overrides, "samples": len(samples), "tokens": tokens,
            "batch_size": batch_size, "engines": rows,
            "capture_over_plain": {name: rows["capture"]["seconds"] / row["seconds"]
                                   for name, row in rows.items() if name != "capture"}}


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--config", required=True)
    arguments.add_argument("--set", action="append", default=[], help="config override KEY=VALUE (repeatable)")
    arguments.add_argument("--method", default=None, help="capture.method to measure (default: the config's)")
    arguments.add_argument("--max-samples", type=int, default=2000)
    arguments.add_argument("--out", type=Path, required=True)
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
    samples = [s for s in load_samples(Path(config.run_dir) / "01_data") if s.split == "train"][: args.max_samples]
    tokens, batch_size = sum(len(s.input_ids) for s in samples), config.capture.batch_size
    capturer_class = ExtractHiddenStatesCapturer if method == "extract_hidden_states" else WorkerExtensionCapturer
    text_only = not any(s.images for s in samples)  # as 02 starts its engine
    rows = {}
    for name, settings in plain_engines(config, capturer_class.ENGINE_SETTINGS).items():
        llm = start_engine(config.target, model_dir, text_only=text_only, **settings)
        vision = None if text_only else Vision.of_engine(llm, model_dir)
        seconds = timed_batches(samples, batch_size, lambda batch: llm.generate(*_prompts(batch, vision), use_tqdm=False))
        rows[name] = {"settings": {"enforce_eager": config.target.engine.enforce_eager} | settings,
                      "seconds": round(seconds, 2), "tokens_per_s": tokens / seconds}
        shut_down(llm)
    capturer = open_capturer(config, model_dir, text, run_aux_layer_ids(config, text["num_hidden_layers"]), text_only)
    seconds = timed_batches(samples, batch_size, capturer.capture,
                            lambda batches: collections.deque(capturer.capture_batches(batches), maxlen=0))
    rows["capture"] = {"method": method, "seconds": round(seconds, 2), "tokens_per_s": tokens / seconds,
                       "parts_s_warmup_included": capturer.seconds.record()}
    shut_down(capturer.llm)
    result = summary(args, overrides, samples, tokens, batch_size, rows)
    save(args.out, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
