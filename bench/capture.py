"""Hidden-state capture cost on the demo target: capture tokens/s against plain vLLM prefill, and disk bytes.

Each variant starts its own engine with the demo config's engine settings (in its own process) and runs the
same fixed-seed prompts with max_tokens=1, after one warm-up batch:

    prefill             plain vLLM, nothing captured (the baseline)
    extract_hidden_states   vLLM's speculative method + the hidden-states connector (stage 02's default here)
    worker_extension    eagle3_pipeline.capture.worker (the vLLM 0.16 and MLA path)

Capture variants include moving the states to host tensors, as stage 02 does (not the shard writing).
Bytes per token on disk are measured by writing the captured states as bf16 and as fp8 shards.

    python bench/capture.py                         # writes bench/results/capture.json
    python bench/capture.py --prompts 32 --length 256
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
VARIANTS = ("prefill", "extract_hidden_states", "worker_extension")


def fixed_prompts(count: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab_size, (count, length), generator=generator).tolist()


def run_variant(variant: str, count: int, length: int, batch: int, out: Path) -> None:
    """Inside the variant's own process: start the engine, time the prompts, write JSON to `out`."""
    from eagle3_pipeline.capture import store
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.target import default_aux_layer_ids, target_path, text_config

    config = load_config(ROOT / "configs" / "demo.yaml", [f"capture.method={variant}"] if variant != "prefill" else [])
    model_dir = target_path(config.target)
    text = text_config(model_dir)
    aux_ids = default_aux_layer_ids(text["num_hidden_layers"])
    prompts = fixed_prompts(count + batch, length, text["vocab_size"])
    if variant == "prefill":
        from vllm import SamplingParams, TokensPrompt

        from eagle3_pipeline.engine import start_engine

        llm = start_engine(config.target, model_dir)
        sampling = SamplingParams(max_tokens=1, temperature=0.0)

        def step(ids):
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], sampling, use_tqdm=False)
            return []
    else:
        from eagle3_pipeline.capture.engine import open_capturer

        capturer = open_capturer(config, model_dir, text, aux_ids)
        step = capturer.capture

    step(prompts[:batch])  # warm-up
    captured, started = [], time.perf_counter()
    for begin in range(batch, len(prompts), batch):
        captured += step(prompts[begin : begin + batch])
    elapsed = time.perf_counter() - started
    result = {"variant": variant, "tokens": count * length, "seconds": elapsed, "tokens_per_s": count * length / elapsed}
    if captured:
        samples = [store.SampleStates(str(i), aux, final) for i, (aux, final) in enumerate(captured)]
        with tempfile.TemporaryDirectory() as folder:
            for dtype in ("bfloat16", "fp8"):
                path = Path(folder) / f"{dtype}.safetensors"
                store.write_shard(path, samples, dtype)
                result[f"bytes_per_token_{dtype}"] = path.stat().st_size / (count * length)
    out.write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--length", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--batch", type=int, default=16, help="prompts per engine call (capture.batch_size)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "capture.json")
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # one variant, in-process
    parser.add_argument("--variant-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        return run_variant(args.variant, args.prompts, args.length, args.batch, args.variant_out)

    results = {}
    with tempfile.TemporaryDirectory() as folder:
        for variant in VARIANTS:
            out = Path(folder) / f"{variant}.json"
            command = [sys.executable, __file__, "--variant", variant, "--variant-out", str(out),
                       "--prompts", str(args.prompts), "--length", str(args.length), "--batch", str(args.batch)]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            results[variant] = json.loads(out.read_text())
    baseline = results["prefill"]["tokens_per_s"]
    print(f"{args.prompts} prompts x {args.length} tokens, batches of {args.batch}, demo engine settings")
    print(f"{'variant':24} {'tokens/s':>9} {'vs prefill':>10} {'B/token bf16':>13} {'B/token fp8':>12}")
    for variant, result in results.items():
        result["overhead_ratio"] = baseline / result["tokens_per_s"]
        print(f"{variant:24} {result['tokens_per_s']:9.0f} {result['overhead_ratio']:9.2f}x "
              f"{result.get('bytes_per_token_bfloat16', float('nan')):13.0f} {result.get('bytes_per_token_fp8', float('nan')):12.0f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
