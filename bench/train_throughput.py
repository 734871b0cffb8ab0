"""Training throughput of the Kimi-shaped EAGLE-3 draft on one GPU: our step (each option) vs speculators 0.9.0's.

All run on the same fixed-seed synthetic batch: one packed row of `--packed-length` tokens in two documents,
aux states [L, 3 x 7168] and final states [L, 7168] in bf16, 3 TTT steps, bf16 autocast over fp32 master
weights, fused AdamW and gradient clipping, in one process one after the other:

    ours                  eagle3_pipeline.train.step.train_step on draft_model.Eagle3Draft with the config's
                          train section as shipped (configs/kimi_k25.yaml: what 04_train runs), lm_head trained
    ours <knob>=<value>   the same with one option switched: train.compile, train.loss_chunk_rows, train.optimizer
                          (Muon's Newton-Schulz iterations per step), train.fp8 (compile and fp8 on GPU only)
    speculators           speculators' Eagle3DraftModel.forward (its torch.compile'd forward, simple_flex_attention,
                          `resolve_loss_config("kl_div", "eager")`: its default fused loss fails under torch 2.11),
                          lm_head frozen as its trainer leaves it, the same optimizer step

Reported per model: median step time over the measured steps (synchronised before and after each), tokens/s,
achieved TFLOP/s from the FLOP count documented in eagle3_pipeline/train/flops.py (each model's own: a frozen
lm_head costs less), MFU against the GPU's dense bf16 peak and against a bf16 matrix product measured here,
peak memory. `--profile` adds the device time per kernel and per kind of kernel (torch profiler, 2 steps);
`--loss-curve N` trains ours with train.fp8 false and true from one initialisation and compares the losses.
Prints a table, writes JSON.

    python -m bench.train_throughput --profile --loss-curve 30   # one H200: the Kimi draft (configs/kimi_k25.yaml)
    python -m bench.train_throughput --tiny                      # CPU smoke test: configs/tiny_kimi.yaml's draft

Needs torch, transformers, accelerate, speculators 0.9.0 (with pydantic), pyyaml, and torchao for fp8; not
datasets or openai, which speculators imports but never calls on this path (stand-ins are installed when they
are missing).
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

from bench.harness import ROOT, versions
IMPORTED_NOT_CALLED = ("datasets", "openai")  # speculators.train.data imports them at module level
CHUNK_ROWS = 1024  # train.loss_chunk_rows measured when the config ships the plain loss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny_kimi draft, short row, CPU friendly")
    parser.add_argument("--packed-length", type=int, help="rows per packed sequence (default 4096; tiny 256)")
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, help="unmeasured steps first (compilation; default 3, tiny 1)")
    parser.add_argument("--steps", type=int, help="measured steps (default 8, tiny 2)")
    parser.add_argument("--only", nargs="+", help="run these variants (names as printed)")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="only write the Markdown tables of an earlier result (JSON -> .md beside it)")
    parser.add_argument("--loss-curve", type=int, default=0, metavar="N",
                        help="also train ours with train.fp8 false and true for N steps from one initialisation "
                             "(4 synthetic batches in turn) and compare the losses")
    parser.add_argument("--out", type=Path, help="JSON result (default bench/results/train_throughput[-tiny].json)")
    parser.add_argument("--profile", action="store_true",
                        help="also profile 2 steps of each model (torch profiler): top kernels and their share")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.render:
        write_markdown(json.loads(args.render.read_text()), args.render.with_suffix(".md"))
        return
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
    options = variants(config.train, device)
    print_header(results)
    for name in args.only or [*options, "speculators"]:
        try:
            results["runs"][name] = measure(name, options.get(name), config, batch, args.ttt_steps, warmup, steps,
                                            device, args.profile)
        except Exception as err:  # noqa: BLE001 - a variant failing (compiler, memory) must not lose the others
            results["runs"][name] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            print(f"{name}: failed: {results['runs'][name]['error'][:300]}")
        else:
            print_row(name, results["runs"][name], results)
            if args.profile:
                print_profile(name, results["runs"][name]["profile"])
        gc.collect()  # the failed variant's model, optimizer and activations too
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.loss_curve:
        try:
            results["loss_curve"] = loss_curves(config, batch, args.ttt_steps, args.loss_curve, device)
        except Exception as err:  # noqa: BLE001 - keep the throughput results
            results["loss_curve"] = {"error": f"{type(err).__name__}: {err}"[:2000]}
            print(f"loss curve: failed: {results['loss_curve']['error'][:300]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, out.with_suffix(".md"))
    print(f"wrote {out} and {out.with_suffix('.md')}")


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


def variants(train, device) -> dict:
    """"ours" (the config's train section as shipped) and "ours <knob>=<other value>" for each speed option."""
    alternatives = {"loss_chunk_rows": None if train.loss_chunk_rows else CHUNK_ROWS,
                    "optimizer": "muon" if train.optimizer == "adamw" else "adamw"}  # Muon's step costs more
    if device.type == "cuda":  # compile and fp8 act on GPUs only
        alternatives |= {"compile": not train.compile, "fp8": not train.fp8}
    options = {"ours": train}
    for knob, value in alternatives.items():
        options[f"ours {knob}={json.dumps(value)}"] = train.model_copy(update={knob: value})
    return options


def synthetic_batch(draft, target_vocab: int, length: int, device, seed: int = 0) -> dict[str, torch.Tensor]:
    """One packed row of two documents, fixed seed, in data.py's layout (batch of 1)."""
    gen = torch.Generator().manual_seed(seed)
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


def prepared_draft(config, batch, device, attention: str, train=None):
    """A draft with the synthetic verifier weights, its optimizer and schedule, prepared by accelerate.

    `train` given: our Eagle3Draft with those train options (draft_model.accelerate_draft, as 04 applies
    them); None: speculators' Eagle3DraftModel, lm_head frozen as its trainer leaves it.
    """
    from accelerate import Accelerator
    from speculators.models.eagle3 import Eagle3DraftModel

    from eagle3_pipeline.train.draft_model import Eagle3Draft, accelerate_draft, build_draft, load_frozen_and_vocab
    from eagle3_pipeline.train.step import lr_schedule, make_optimizer
    from eagle3_pipeline.train.verifier import VerifierWeights

    cuda = device.type == "cuda"
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda else "no")
    torch._dynamo.reset()  # each model compiles afresh: the models share speculators' layer code
    torch.manual_seed(0)
    vocab = batch["embed"].shape[0]
    model = build_draft(config.draft, [2, 30, 58], vocab, attention,
                        model_class=Eagle3Draft if train is not None else Eagle3DraftModel,
                        standardize_aux=train is not None and train.standardize_aux)  # its multiply, scales of 1
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[batch["kept"]] = True
    verifier = VerifierWeights(batch["embed"], torch.ones(config.draft.hidden_size), batch["lm_head"], 1e-5, False)
    load_frozen_and_vocab(model, verifier, batch["kept"] - torch.arange(len(batch["kept"])), t2d)
    if train is None:
        model.lm_head.weight.requires_grad_(False)
    else:
        accelerate_draft(model, train, device)
    options = train if train is not None else config.train  # speculators' model: the config's optimizer (AdamW)
    optimizer = make_optimizer(model.to(device), options)
    scheduler = lr_schedule(optimizer, options)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer, scheduler


INPUTS = ("aux", "final", "input_ids", "position_ids", "document_ids", "loss_mask")


def build(train, config, batch, device):
    """The model and a function running one optimizer step of it (ours with `train`; None: speculators)."""
    from eagle3_pipeline.train.attention import resolve_attention
    from eagle3_pipeline.train.step import train_step

    inputs = {k: batch[k] for k in INPUTS}
    clip = config.train.grad_clip
    if train is not None:
        accelerator, model, optimizer, scheduler = prepared_draft(
            config, batch, device, resolve_attention(train.attention, device), train)
        return accelerator, model, lambda ttt, data=inputs: train_step(model, optimizer, scheduler, [data],
                                                                       accelerator, ttt, [1.0] * ttt, clip)

    from speculators.losses import resolve_loss_config

    # its own attention (flex; it has no CPU backward, so sdpa there) and its own forward
    attention = "simple_flex_attention" if device.type == "cuda" else "sdpa"
    accelerator, model, optimizer, scheduler = prepared_draft(config, batch, device, attention)
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


def loss_curves(config, batch, ttt_steps: int, steps: int, device) -> dict:
    """Mean TTT loss per step of ours with train.fp8 false and true, same initialisation and batches."""
    draft, vocab, length = config.draft, batch["embed"].shape[0], batch["aux"].shape[1]
    data = [batch] + [synthetic_batch(draft, vocab, length, device, seed) for seed in (1, 2, 3)]
    curves = {}
    for fp8 in (False, True):
        accelerator, model, step = build(config.train.model_copy(update={"fp8": fp8}), config, batch, device)
        losses = []
        for index in range(steps):
            stats, _ = step(ttt_steps, {k: data[index % len(data)][k] for k in INPUTS})
            losses.append(float((stats[0] / stats[2].clamp(min=1)).mean()))
        curves["fp8" if fp8 else "bf16"] = losses
        accelerator.free_memory(model)
        del model, step
        gc.collect()
    relative = [abs(a - b) / abs(a) for a, b in zip(curves["bf16"], curves["fp8"], strict=True)]
    curves["max_rel_diff"] = max(relative)
    curves["last_rel_diff"] = relative[-1]
    print(f"loss curve over {steps} steps: bf16 {curves['bf16'][0]:.4f} -> {curves['bf16'][-1]:.4f}, fp8 "
          f"{curves['fp8'][0]:.4f} -> {curves['fp8'][-1]:.4f}; max relative difference {curves['max_rel_diff']:.2%}")
    return curves


def measure(name: str, train, config, batch, ttt_steps: int, warmup: int, steps: int, device, profile: bool) -> dict:
    from eagle3_pipeline.train.flops import attended_keys, train_flops

    if name != "speculators" and train is None:
        raise ValueError(f"no variant {name!r}")
    accelerator, model, step = build(train, config, batch, device)
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
                        lm_head_trained=train is not None)
    run = {"step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12,
           "gflop_per_token": flops / tokens / 1e9,
           "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    if train is not None:
        run["options"] = train.model_dump(include={"compile", "loss_chunk_rows", "fp8", "attention", "optimizer"})
    if profile:
        run["profile"] = profile_steps(step, ttt_steps, device)
    accelerator.free_memory(model)
    return run


KERNEL_KINDS = (  # first match wins; names as the CUDA profiler reports them
    ("flex attention", ("flex",)),
    ("fused elementwise (compiled)", ("triton_",)),  # inductor's kernels, fp8 scaling (`_scaled_mm_` in name) too
    ("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
    ("optimizer", ("adam", "multi_tensor")),
    ("copy", ("memcpy", "memset", "copy_")),
)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(key in lowered for key in keys)), "other (eager aten)")


def profile_steps(step, ttt_steps: int, device, steps: int = 2, top: int = 15) -> dict:
    """Device time per step by kernel and by kind (torch profiler over `steps` steps), and the idle share."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if device.type == "cuda" else [ProfilerActivity.CPU]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step(ttt_steps)
        sync()
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    kernels = {}
    for event in prof.events():
        if event.device_type.name != ("CUDA" if device.type == "cuda" else "CPU"):
            continue
        entry = kernels.setdefault(event.name, [0, 0.0])
        entry[0] += 1
        entry[1] += event.time_range.elapsed_us() if device.type == "cuda" else event.self_cpu_time_total
    busy_ms = sum(us for _, us in kernels.values()) / 1e3 / steps
    kinds: dict[str, float] = {}
    for name, (_, us) in kernels.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us / 1e3 / steps
    ranked = sorted(kernels.items(), key=lambda item: -item[1][1])[:top]
    return {
        "wall_ms": wall_ms, "kernel_ms": busy_ms, "idle_share": max(0.0, 1 - busy_ms / wall_ms),
        "kinds": {kind: {"ms": ms, "share": ms / busy_ms} for kind, ms in sorted(kinds.items(), key=lambda x: -x[1])},
        "top_kernels": [{"name": name[:160], "kind": kernel_kind(name), "calls": calls // steps,
                         "ms": us / 1e3 / steps, "share": us / 1e3 / steps / busy_ms}
                        for name, (calls, us) in ranked],
    }


def print_profile(name: str, profile: dict) -> None:
    print(f"  {name}: {profile['kernel_ms']:.1f} ms of kernels per step, {profile['wall_ms']:.1f} ms wall "
          f"(GPU idle {profile['idle_share']:.1%})")
    for kind, value in profile["kinds"].items():
        print(f"    {kind:<30} {value['ms']:>8.1f} ms {value['share']:>6.1%}")
    for kernel in profile["top_kernels"]:
        print(f"    {kernel['share']:>6.1%} {kernel['ms']:>7.2f} ms x{kernel['calls']:<4} {kernel['name'][:100]}")


def write_markdown(results: dict, path: Path) -> None:
    """The throughput table, and per profiled model its kinds of kernels and top kernels."""
    peak = results["peak_bf16_tflops"]
    lines = [f"{results['device']}, packed {results['packed_length']}, {results['ttt_steps']} TTT steps, median of "
             f"{results['measured_steps']} steps; bf16 matmul measured {results['matmul_tflops']:.0f} TFLOP/s", "",
             f"| model | tokens/s | step ms | TFLOP/s | MFU ({peak:.0f} peak) | trainable | peak GiB |",
             "|---|---|---|---|---|---|---|"]
    for name, run in results["runs"].items():
        if "error" in run:
            lines.append(f"| {name} | failed: {run['error'][:120]} | | | | | |")
            continue
        mfu = f"{run['tflops'] / peak:.1%}" if peak else "-"
        memory = f"{run['peak_memory_gib']:.1f}" if run["peak_memory_gib"] is not None else "-"
        lines.append(f"| {name} | {run['tokens_per_s']:,.0f} | {run['step_ms']:.1f} | {run['tflops']:.0f} | {mfu} | "
                     f"{run['trainable_parameters'] / 1e6:,.0f} M | {memory} |")
    curve = results.get("loss_curve")
    if curve and "error" not in curve:
        bf16, fp8 = curve["bf16"], curve["fp8"]
        lines += ["", f"Loss curve ({len(bf16)} steps): bf16 {bf16[0]:.4f} -> {bf16[-1]:.4f}, "
                      f"fp8 {fp8[0]:.4f} -> {fp8[-1]:.4f}; max relative difference "
                      f"{curve['max_rel_diff']:.2%}, last {curve['last_rel_diff']:.2%}"]
    for name, run in results["runs"].items():
        profile = run.get("profile")
        if not profile:
            continue
        lines += ["", f"### {name}: {profile['kernel_ms']:.1f} ms of kernels per step, {profile['wall_ms']:.1f} ms "
                      f"wall under the profiler (GPU idle {profile['idle_share']:.1%})", "",
                  "| kind | ms per step | share |", "|---|---|---|"]
        lines += [f"| {kind} | {v['ms']:.1f} | {v['share']:.1%} |" for kind, v in profile["kinds"].items()]
        lines += ["", "| share | ms per step | calls | kernel |", "|---|---|---|---|"]
        lines += [f"| {k['share']:.1%} | {k['ms']:.2f} | {k['calls']} | `{k['name'][:100]}` |"
                  for k in profile["top_kernels"]]
    path.write_text("\n".join(lines) + "\n")


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




def print_header(results: dict) -> None:
    print(f"{results['device']}: packed {results['packed_length']}, {results['ttt_steps']} TTT steps, "
          f"median of {results['measured_steps']} steps; measured matmul {results['matmul_tflops']:.0f} TFLOP/s")
    print(f"{'model':<26} {'tokens/s':>10} {'step ms':>9} {'TFLOP/s':>8} {'MFU':>6} {'of matmul':>9} "
          f"{'GFLOP/tok':>9} {'trainable':>10} {'peak GiB':>8}")


def print_row(name: str, run: dict, results: dict) -> None:
    peak = results["peak_bf16_tflops"]
    mfu = f"{run['tflops'] / peak:.1%}" if peak else "-"
    memory = f"{run['peak_memory_gib']:.1f}" if run["peak_memory_gib"] is not None else "-"
    print(f"{name:<26} {run['tokens_per_s']:>10.0f} {run['step_ms']:>9.1f} {run['tflops']:>8.1f} {mfu:>6} "
          f"{run['tflops'] / results['matmul_tflops']:>9.1%} {run['gflop_per_token']:>9.2f} "
          f"{run['trainable_parameters'] / 1e6:>9.1f}M {memory:>8}")


if __name__ == "__main__":
    main()
