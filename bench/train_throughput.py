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
lm_head costs less), MFU against the GPU's dense bf16 peak (a bf16 matrix product's rate measured here beside it),
peak memory. `--profile` adds the device time per kernel and per kind of kernel (torch profiler, 2 steps);
`--loss-curve N` trains ours with train.fp8 false and true from one initialisation and compares the losses.
Prints each model's row of the report as it is measured; writes the JSON and the report (.md).

    python -m bench.train_throughput --profile --loss-curve 30   # one H200: the Kimi draft (configs/kimi_k25.yaml)
    python -m bench.train_throughput --tiny                      # CPU smoke test: configs/tiny_kimi.yaml's draft
    python -m bench.train_throughput --only ours --set draft.draft_vocab_size=163840   # the full-vocabulary draft

Needs torch, transformers, accelerate, speculators 0.9.0 (with pydantic), pyyaml, and torchao for fp8; not
datasets or openai, which speculators imports but never calls on this path (stand-ins are installed when they
are missing).
"""

from __future__ import annotations

import gc
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import RESULTS, ROOT, failure, parser, save, stand_ins, synchronize, versions

CHUNK_ROWS = 1024  # train.loss_chunk_rows measured when the config ships the plain loss


def parse_args():
    arguments = parser(__doc__)
    arguments.add_argument("--tiny", action="store_true", help="tiny_kimi draft, short row, CPU friendly")
    arguments.add_argument("--packed-length", type=int, help="rows per packed sequence (default 4096; tiny 256)")
    arguments.add_argument("--ttt-steps", type=int, default=3)
    arguments.add_argument("--warmup", type=int, help="unmeasured steps first (compilation; default 3, tiny 1)")
    arguments.add_argument("--steps", type=int, help="measured steps (default 8, tiny 2)")
    arguments.add_argument("--only", nargs="+", help="run these variants (names as printed)")
    arguments.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="config override for every variant (repeatable), for example "
                                "draft.draft_vocab_size=163840: the full-vocabulary draft")
    arguments.add_argument("--render", type=Path, metavar="JSON",
                           help="only write the Markdown tables of an earlier result (JSON -> .md beside it)")
    arguments.add_argument("--loss-curve", type=int, default=0, metavar="N",
                           help="also train ours with train.fp8 false and true for N steps from one initialisation "
                                "(4 synthetic batches in turn) and compare the losses")
    arguments.add_argument("--out", type=Path, help="JSON result (default bench/results/train_throughput[-tiny].json)")
    arguments.add_argument("--profile", action="store_true",
                           help="also profile 2 steps of each model (torch profiler): top kernels and their share")
    args = arguments.parse_args()
    tiny = args.tiny
    args.packed_length = args.packed_length or (256 if tiny else 4096)
    args.warmup, args.steps = args.warmup or (1 if tiny else 3), args.steps or (2 if tiny else 8)
    args.out = args.out or RESULTS / f"train_throughput{'-tiny' if tiny else ''}.json"
    return args


def main() -> None:
    args = parse_args()
    if args.render:
        write_markdown(json.loads(args.render.read_text()), args.render.with_suffix(".md"))
        return
    import transformers  # noqa: F401  (loaded before the stand-ins below, so it never sees them)

    stand_ins(Path(tempfile.mkdtemp(prefix="bench-stand-ins-")))
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.train.flops import peak_flops

    config = load_config(ROOT / "configs" / ("tiny_kimi.yaml" if args.tiny else "kimi_k25.yaml"), args.set)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    batch = synthetic_batch(config.draft, target_vocab=163840, length=args.packed_length, device=device)
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "packed_length": args.packed_length, "ttt_steps": args.ttt_steps, "measured_steps": args.steps,
               "overrides": args.set, "peak_bf16_tflops": (peak_flops(device) or 0) / 1e12,
               "matmul_tflops": matmul_tflops(device), "versions": versions(), "runs": {}}
    options = variants(config.train, device)
    print("\n".join(header_lines(results)))
    for name in args.only or [*options, "speculators"]:
        try:
            run = results["runs"][name] = measure(name, options.get(name), config, batch, args, device)
        except Exception as err:  # noqa: BLE001 - a variant failing (compiler, memory) must not lose the others
            run = results["runs"][name] = {"error": failure(err)}
        print("\n".join([run_line(name, run, results["peak_bf16_tflops"]), *profile_lines(name, run)]), flush=True)
        gc.collect()  # the failed variant's model, optimizer and activations too
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.loss_curve:
        try:
            results["loss_curve"] = loss_curves(config, batch, args.ttt_steps, args.loss_curve, device)
        except Exception as err:  # noqa: BLE001 - keep the throughput results
            results["loss_curve"] = {"error": failure(err)}
            print(f"loss curve: failed: {results['loss_curve']['error'][:300]}")
        print(*loss_curve_lines(results), sep="\n")
    save(args.out, results)
    write_markdown(results, args.out.with_suffix(".md"))
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


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
    """One packed row of two documents, fixed seed, in data.py's layout (batch of 1); the verifier's weights and the
    kept vocabulary stay on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    h, half = draft.hidden_size, length // 2
    states = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU runs without autocast
    batch = {
        "aux": torch.randn(1, length, 3 * h, generator=gen).to(torch.bfloat16).to(states),
        "final": torch.randn(1, length, h, generator=gen).to(torch.bfloat16).to(states),
        "input_ids": torch.randint(0, target_vocab, (1, length), generator=gen),
        "position_ids": torch.cat([torch.arange(half), torch.arange(length - half)])[None],
        "document_ids": torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(length - half, dtype=torch.long)])[None],
        "loss_mask": torch.ones(1, length, dtype=torch.bool),
    }
    return {name: t.to(device) for name, t in batch.items()} | {
        "embed": torch.randn(target_vocab, h, generator=gen) * 0.02,
        "lm_head": torch.randn(target_vocab, h, generator=gen) * 0.02,
        "kept": torch.randperm(target_vocab, generator=gen)[: draft.draft_vocab_size].sort().values}


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
    return curves | {"max_rel_diff": max(relative), "last_rel_diff": relative[-1]}


def timed(step, ttt_steps: int, device, steps: int) -> list[float]:
    """Seconds of each of `steps` steps, the device synchronised before and after each."""
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        step(ttt_steps)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def measure(name: str, train, config, batch, args, device) -> dict:
    from eagle3_pipeline.train.flops import attended_keys, train_flops

    if name != "speculators" and train is None:
        raise ValueError(f"no variant {name!r}")
    accelerator, model, step = build(train, config, batch, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed(step, args.ttt_steps, device, args.warmup)
    seconds = statistics.median(timed(step, args.ttt_steps, device, args.steps))
    tokens = int((batch["document_ids"] >= 0).sum())
    flops = train_flops(config.draft, 3, args.ttt_steps, tokens, attended_keys(batch["document_ids"], args.ttt_steps),
                        lm_head_trained=train is not None)
    run = {"step_ms": seconds * 1e3, "tokens_per_s": tokens / seconds, "tflops": flops / seconds / 1e12,
           "gflop_per_token": flops / tokens / 1e9,
           "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    if train is not None:
        run["options"] = train.model_dump(include={"compile", "loss_chunk_rows", "fp8", "attention", "optimizer"})
    if args.profile:
        run["profile"] = profile_steps(step, args.ttt_steps, device)
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

    cuda = device.type == "cuda"
    synchronize(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step(ttt_steps)
        synchronize(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / steps
    kernels = {}
    for event in prof.events():
        if event.device_type.name == ("CUDA" if cuda else "CPU"):
            entry = kernels.setdefault(event.name, [0, 0.0])
            entry[0] += 1
            entry[1] += event.time_range.elapsed_us() if cuda else event.self_cpu_time_total
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


def header_lines(results: dict) -> list[str]:
    overrides = "".join(f", {override}" for override in results.get("overrides", []))
    return [f"{results['device']}, packed {results['packed_length']}{overrides}, {results['ttt_steps']} TTT steps, "
            f"median of {results['measured_steps']} steps; bf16 matmul measured {results['matmul_tflops']:.0f} "
            "TFLOP/s", "",
            f"| model | tokens/s | step ms | TFLOP/s | MFU ({results['peak_bf16_tflops']:.0f} peak) | trainable | "
            "peak GiB |", "|---|---|---|---|---|---|---|"]


def run_line(name: str, run: dict, peak: float) -> str:
    if "error" in run:
        return f"| {name} | failed: {run['error'][:120]} | | | | | |"
    mfu = f"{run['tflops'] / peak:.1%}" if peak else "-"
    memory = f"{run['peak_memory_gib']:.1f}" if run["peak_memory_gib"] is not None else "-"
    return (f"| {name} | {run['tokens_per_s']:,.0f} | {run['step_ms']:.1f} | {run['tflops']:.0f} | {mfu} | "
            f"{run['trainable_parameters'] / 1e6:,.0f} M | {memory} |")


def loss_curve_lines(results: dict) -> list[str]:
    curve = results.get("loss_curve")
    if not curve or "error" in curve:
        return []
    bf16, fp8 = curve["bf16"], curve["fp8"]
    return ["", f"Loss curve ({len(bf16)} steps): bf16 {bf16[0]:.4f} -> {bf16[-1]:.4f}, fp8 {fp8[0]:.4f} -> "
                f"{fp8[-1]:.4f}; max relative difference {curve['max_rel_diff']:.2%}, last {curve['last_rel_diff']:.2%}"]


def profile_lines(name: str, run: dict) -> list[str]:
    """A profiled model's kinds of kernels and top kernels (none without a profile)."""
    profile = run.get("profile")
    if not profile:
        return []
    return ["", f"### {name}: {profile['kernel_ms']:.1f} ms of kernels per step, {profile['wall_ms']:.1f} ms wall "
                f"under the profiler (GPU idle {profile['idle_share']:.1%})", "",
            "| kind | ms per step | share |", "|---|---|---|",
            *(f"| {kind} | {v['ms']:.1f} | {v['share']:.1%} |" for kind, v in profile["kinds"].items()),
            "", "| share | ms per step | calls | kernel |", "|---|---|---|---|",
            *(f"| {k['share']:.1%} | {k['ms']:.2f} | {k['calls']} | `{k['name'][:100]}` |"
              for k in profile["top_kernels"])]


def write_markdown(results: dict, path: Path) -> None:
    """The throughput table, the loss curve, and per profiled model its kinds of kernels and top kernels."""
    lines = header_lines(results) + [run_line(name, run, results["peak_bf16_tflops"])
                                     for name, run in results["runs"].items()]
    lines += loss_curve_lines(results)
    for name, run in results["runs"].items():
        lines += profile_lines(name, run)
    path.write_text("\n".join(lines) + "\n")


def matmul_tflops(device) -> float:
    """bf16 (fp32 on CPU) matrix product rate here: the practical ceiling of any step."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    seconds = timed(lambda _: [a @ b for _ in range(20)], 0, device, 2)[-1]  # the first pass warms up
    return 2 * n**3 * 20 / seconds / 1e12


if __name__ == "__main__":
    main()
