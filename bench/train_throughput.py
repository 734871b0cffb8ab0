"""Training throughput of the Kimi-shaped EAGLE-3 draft on one GPU: our step vs speculators 0.9.0's model.

Both run on the same fixed-seed synthetic batch: one packed row of `--packed-length` tokens in two documents,
aux states [L, 3 x 7168] and final states [L, 7168] in bf16, 3 TTT steps, bf16 autocast over fp32 master
weights, fused AdamW and gradient clipping, in one process one after the other:

    ours         eagle3_pipeline.train.step.train_step on draft_model.Eagle3Draft (what 04_train runs):
                 compiled flex attention, lm_head trained
    ours+compile the same with `train.compile: true` (each decoder layer torch.compile'd; GPU only)
    speculators  speculators' Eagle3DraftModel.forward (its torch.compile'd forward, simple_flex_attention,
                 `resolve_loss_config("kl_div", "eager")`: its default fused loss fails under torch 2.11),
                 lm_head frozen as its trainer leaves it, the same optimizer step

Reported per model: median step time over the measured steps, tokens/s, achieved TFLOP/s from the FLOP count
documented in eagle3_pipeline/train/flops.py (each model's own: a frozen lm_head costs less), MFU against the
GPU's dense bf16 peak, and against a bf16 matrix product measured here. Prints a table, writes JSON.

    python bench/train_throughput.py                     # one H200: the Kimi draft (configs/kimi_k25.yaml)
    python bench/train_throughput.py --tiny              # CPU smoke test: configs/tiny_kimi.yaml's draft

Needs torch, transformers, accelerate, speculators 0.9.0 (with pydantic), pyyaml; not datasets or openai,
which speculators imports but never calls on this path (stand-ins are installed when they are missing).
"""

from __future__ import annotations

import argparse
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
IMPORTED_NOT_CALLED = ("datasets", "openai")  # speculators.train.data imports them at module level
VARIANTS = ("ours", "ours+compile", "speculators")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny_kimi draft, short row, CPU friendly")
    parser.add_argument("--packed-length", type=int, help="rows per packed sequence (default 4096; tiny 256)")
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, help="unmeasured steps first (compilation; default 3, tiny 1)")
    parser.add_argument("--steps", type=int, help="measured steps (default 8, tiny 2)")
    parser.add_argument("--only", choices=VARIANTS, help="run one variant")
    parser.add_argument("--out", type=Path, help="JSON result (default bench/results/train_throughput[-tiny].json)")
    args = parser.parse_args()
    length = args.packed_length or (256 if args.tiny else 4096)
    warmup, steps = args.warmup or (1 if args.tiny else 3), args.steps or (2 if args.tiny else 8)
    out = args.out or ROOT / "bench" / "results" / f"train_throughput{'-tiny' if args.tiny else ''}.json"

    import transformers  # noqa: F401  (loaded before the stand-ins below, so it never sees them)

    stand_in_missing_modules(IMPORTED_NOT_CALLED)
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.train.flops import peak_flops

    config = load_config(ROOT / "configs" / ("tiny_kimi.yaml" if args.tiny else "kimi_k25.yaml"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = synthetic_batch(config.draft, target_vocab=163840, length=length, device=device)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "packed_length": length, "ttt_steps": args.ttt_steps, "measured_steps": steps,
               "peak_bf16_tflops": (peak_flops(device) or 0) / 1e12, "matmul_tflops": matmul_tflops(device),
               "versions": versions(), "runs": {}}
    variants = [args.only] if args.only else [v for v in VARIANTS if device.type == "cuda" or v != "ours+compile"]
    print_header(results)
    for name in variants:
        try:
            results["runs"][name] = measure(name, config, batch, args.ttt_steps, warmup, steps, device)
        except Exception as err:  # noqa: BLE001 - a variant failing (compiler, memory) must not lose the others
            results["runs"][name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            print(f"{name}: failed: {results['runs'][name]['error'][:300]}")
        else:
            print_row(name, results["runs"][name], results)
        gc.collect()  # the failed variant's model, optimizer and activations too
        if device.type == "cuda":
            torch.cuda.empty_cache()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")


class EmptyPackages(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty stand-ins (submodules included) for packages speculators imports but this benchmark never calls."""

    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__getattr__ = _placeholder  # `from <stand-in> import X` yields an empty class X
        return module

    def exec_module(self, module) -> None:
        pass


def _placeholder(attr: str):
    if attr.startswith("__"):
        raise AttributeError(attr)
    return type(attr, (), {})


def stand_in_missing_modules(names) -> None:
    missing = {name for name in names if importlib.util.find_spec(name) is None}
    if missing:
        print(f"note: {', '.join(sorted(missing))} not installed: speculators is imported with empty stand-ins")
        sys.meta_path.append(EmptyPackages(missing))  # last: consulted only when nothing else has the module


def synthetic_batch(draft, target_vocab: int, length: int, device) -> dict[str, torch.Tensor]:
    """One packed row of two documents, fixed seed, in data.py's layout (batch of 1)."""
    gen = torch.Generator().manual_seed(0)
    h = draft.hidden_size
    half = length // 2
    documents = torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(length - half, dtype=torch.long)])
    batch = {
        "aux": torch.randn(1, length, 3 * h, generator=gen).to(torch.bfloat16),
        "final": torch.randn(1, length, h, generator=gen).to(torch.bfloat16),
        "input_ids": torch.randint(0, target_vocab, (1, length), generator=gen),
        "position_ids": torch.cat([torch.arange(half), torch.arange(length - half)])[None],
        "document_ids": documents[None],
        "loss_mask": torch.ones(1, length, dtype=torch.bool),
        "embed": torch.randn(target_vocab, h, generator=gen) * 0.02,
        "lm_head": torch.randn(target_vocab, h, generator=gen) * 0.02,
        "kept": torch.randperm(target_vocab, generator=gen)[: draft.draft_vocab_size].sort().values,
    }
    states = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU runs without autocast
    for name in ("aux", "final"):
        batch[name] = batch[name].to(states)
    return {name: t.to(device) if name not in ("embed", "lm_head", "kept") else t for name, t in batch.items()}


def prepared_draft(config, batch, device, attention: str, model_class=None, compile_layers=False):
    """A draft with the synthetic verifier weights, its optimizer and schedule, prepared by accelerate."""
    from accelerate import Accelerator

    from eagle3_pipeline.train import draft_model
    from eagle3_pipeline.train.draft_model import Eagle3Draft, build_draft, load_frozen_and_vocab
    from eagle3_pipeline.train.step import lr_schedule, make_optimizer
    from eagle3_pipeline.train.verifier import VerifierWeights

    cuda = device.type == "cuda"
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda else "no")
    torch.manual_seed(0)
    vocab = batch["embed"].shape[0]
    model = build_draft(config.draft, [2, 30, 58], vocab, attention, model_class=model_class or Eagle3Draft)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[batch["kept"]] = True
    verifier = VerifierWeights(batch["embed"], torch.ones(config.draft.hidden_size), batch["lm_head"], 1e-5, False)
    load_frozen_and_vocab(model, verifier, batch["kept"] - torch.arange(len(batch["kept"])), t2d)
    if model_class is not None:
        model.lm_head.weight.requires_grad_(False)  # speculators' trainer leaves lm_head frozen
    if compile_layers:
        draft_model.compile_layers(model)
    optimizer = make_optimizer(model.to(device), config.train)
    scheduler = lr_schedule(optimizer, config.train)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer, scheduler


def build(name: str, config, batch, device):
    """The model and a function running one optimizer step of it."""
    from eagle3_pipeline.train.attention import resolve_attention
    from eagle3_pipeline.train.step import train_step

    inputs = {k: batch[k] for k in ("aux", "final", "input_ids", "position_ids", "document_ids", "loss_mask")}
    clip = config.train.grad_clip
    if name.startswith("ours"):
        accelerator, model, optimizer, scheduler = prepared_draft(
            config, batch, device, resolve_attention("auto", device), compile_layers=name == "ours+compile")
        return accelerator, model, lambda ttt: train_step(model, optimizer, scheduler, [inputs], accelerator,
                                                          ttt, [1.0] * ttt, clip)

    from speculators.losses import resolve_loss_config
    from speculators.models.eagle3 import Eagle3DraftModel

    # its own attention (flex; it has no CPU backward, so sdpa there) and its own forward
    attention = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    accelerator, model, optimizer, scheduler = prepared_draft(config, batch, device, attention, Eagle3DraftModel)
    eager_kl = resolve_loss_config("kl_div", "eager")

    def step(ttt_steps: int) -> None:
        optimizer.zero_grad(set_to_none=True)
        _, loss, _ = model(hidden_states=inputs["aux"], input_ids=inputs["input_ids"],
                           document_ids=inputs["document_ids"], loss_mask=inputs["loss_mask"],
                           position_ids=inputs["position_ids"] + 1, verifier_last_hidden_states=inputs["final"],
                           ttt_steps=ttt_steps, loss_config=eager_kl)
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        scheduler.step()

    return accelerator, model, step


def measure(name: str, config, batch, ttt_steps: int, warmup: int, steps: int, device) -> dict:
    from eagle3_pipeline.train.flops import attended_keys, train_flops

    accelerator, model, step = build(name, config, batch, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for _ in range(warmup):
        step(ttt_steps)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step(ttt_steps)
        sync()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    tokens = int((batch["document_ids"] >= 0).sum())
    flops = train_flops(config.draft, 3, ttt_steps, tokens, attended_keys(batch["document_ids"], ttt_steps),
                        lm_head_trained=name.startswith("ours"))
    run = {"step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12,
           "gflop_per_token": flops / tokens / 1e9,
           "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    accelerator.free_memory(model)
    return run


def matmul_tflops(device) -> float:
    """bf16 (fp32 on CPU) matrix product rate here: the practical ceiling of any step."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    start, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        a @ b
    sync()
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for package in ("torch", "transformers", "accelerate", "speculators"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "absent"
    return found


def print_header(results: dict) -> None:
    print(f"{results['device']}: packed {results['packed_length']}, {results['ttt_steps']} TTT steps, "
          f"median of {results['measured_steps']} steps; measured matmul {results['matmul_tflops']:.0f} TFLOP/s")
    print(f"{'model':<13} {'tokens/s':>10} {'step ms':>9} {'TFLOP/s':>8} {'MFU':>6} {'of matmul':>9} "
          f"{'GFLOP/tok':>9} {'trainable':>10} {'peak GiB':>8}")


def print_row(name: str, run: dict, results: dict) -> None:
    peak = results["peak_bf16_tflops"]
    mfu = f"{run['tflops'] / peak:.1%}" if peak else "-"
    memory = f"{run['peak_memory_gib']:.1f}" if run["peak_memory_gib"] is not None else "-"
    print(f"{name:<13} {run['tokens_per_s']:>10.0f} {run['step_ms']:>9.1f} {run['tflops']:>8.1f} {mfu:>6} "
          f"{run['tflops'] / results['matmul_tflops']:>9.1%} {run['gflop_per_token']:>9.2f} "
          f"{run['trainable_parameters'] / 1e6:>9.1f}M {memory:>8}")


if __name__ == "__main__":
    main()
