"""vLLM CPU decode speed on the demo target against `target.engine.cpu_reserved_cores` and max_num_seqs.

vLLM's CPU backend keeps one core per worker free of its OpenMP threads for the scheduler process by
default; `cpu_reserved_cores: 0` (VLLM_CPU_NUM_OF_RESERVED_CPU=0) runs the model on every core. Each setting
starts its own engine (in its own process) through `engine.start_engine` with the demo config's settings and
generates greedily for the same chat prompts, every one to --max-tokens tokens (ignore_eos), as 01's
self-distillation does:

    python bench/cpu_threads.py                    # writes bench/results/cpu_threads.json
    python bench/cpu_threads.py --prompts 64 --max-tokens 80 --seqs 32 64

Run it on an otherwise idle machine: with another job on the cores, OpenMP threads bound to every core wait
on each other, and `cpu_reserved_cores: 0` can be far slower than the default.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESERVED = ("default", "0")  # default = vLLM's own choice (the config's null)


def run_setting(reserved: str, seqs: int, prompts: int, max_tokens: int, out: Path) -> None:
    """Inside the setting's own process: start the engine, time the generation, write JSON to `out`."""
    from vllm import SamplingParams

    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.engine import start_engine
    from eagle3_pipeline.target import target_path

    overrides = [f"target.engine.max_num_seqs={seqs}",
                 f"target.engine.cpu_reserved_cores={'null' if reserved == 'default' else reserved}"]
    config = load_config(ROOT / "configs" / "demo.yaml", overrides)
    llm = start_engine(config.target, target_path(config.target))
    chats = [[{"role": "user", "content": f"Write a short story about the number {i}."}] for i in range(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    started = time.perf_counter()
    results = llm.chat(chats, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    out.write_text(json.dumps({"cpu_reserved_cores": reserved, "max_num_seqs": seqs, "generated_tokens": tokens,
                               "seconds": seconds, "tokens_per_s": tokens / seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=80, help="tokens generated per prompt")
    parser.add_argument("--seqs", type=int, nargs="+", default=[32, 64], help="max_num_seqs values")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_threads.json")
    parser.add_argument("--setting", nargs=2, help=argparse.SUPPRESS)  # reserved seqs: one setting, in-process
    parser.add_argument("--setting-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.setting:
        return run_setting(args.setting[0], int(args.setting[1]), args.prompts, args.max_tokens, args.setting_out)

    results = []
    with tempfile.TemporaryDirectory() as folder:
        for seqs in args.seqs:
            for reserved in RESERVED:
                out = Path(folder) / f"{reserved}_{seqs}.json"
                command = [sys.executable, __file__, "--setting", reserved, str(seqs), "--setting-out", str(out),
                           "--prompts", str(args.prompts), "--max-tokens", str(args.max_tokens)]
                subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=os.environ | {"HF_HUB_OFFLINE": "1"})
                results.append(json.loads(out.read_text()))
    print(f"{args.prompts} chat prompts x {args.max_tokens} tokens, greedy, demo engine settings, "
          f"{os.cpu_count()} CPU cores")
    print(f"{'max_num_seqs':>12} {'cpu_reserved_cores':>18} {'tokens/s':>9} {'vs default':>10}")
    for result in results:
        default = next(r for r in results if r["max_num_seqs"] == result["max_num_seqs"]
                       and r["cpu_reserved_cores"] == "default")
        result["speedup_vs_default"] = result["tokens_per_s"] / default["tokens_per_s"]
        print(f"{result['max_num_seqs']:12} {result['cpu_reserved_cores']:>18} {result['tokens_per_s']:9.1f} "
              f"{result['speedup_vs_default']:9.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": "python bench/cpu_threads.py " + " ".join(sys.argv[1:]),
                                    "load_average_after": os.getloadavg(), "results": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
