"""How fast captured states leave the GPU: the worker extension's recording path, without vLLM.

Drives `eagle3_pipeline.capture.worker`'s `_record_step` / `pop_captured` and `capture.handover`'s `load_captured`
with synthetic states of Kimi-K2.5's shape (hidden 7168, 3 aux layers + final, bf16) in forward steps of 8k-16k
tokens, several requests per step, the way vLLM's model runner presents them. Per variant it reports the end-to-end
hand-over (first step recorded -> every state in a file or mapping the main process can read, i.e. `pop_captured`
returned), in GB/s of bytes handed over and microseconds per token, and the main process's read (`load_captured`,
which copies the states out) separately:

    pageable       today's path: `.cpu()` per step, one safetensors file per request
    mapped         copies on a side stream into reused page-locked slabs the main process maps
    pageable_fp8   today's fp8: the pageable hand-over, then quantised on the CPU as the shard writer does
    mapped_fp8     quantised on the GPU (`quantize_fp8`) before the mapped copy (half the bytes)

With `--forward-tokens-per-s R` each step also runs a synthetic forward (bf16 matrix products lasting
tokens / R seconds) before it is recorded; `exposed_us_per_token` is then what capture adds to the forwards
(hand-over time the overlap does not hide). Raw single-copy rates (pageable, pinned, mapped slab) come first.

    python -m bench.capture_handover --steps 6 --out bench/results/capture_handover_h200.json   # on the H200
    python -m bench.capture_handover --device cpu --steps 2 --hidden 64 --tokens 96 128 --out /tmp/h.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch


from bench.harness import ROOT
from eagle3_pipeline.capture.handover import MappedArena, load_captured
from eagle3_pipeline.capture.store import bytes_per_token, quantize_fp8
from eagle3_pipeline.capture.worker import HiddenStateCapture

VARIANTS = ("pageable", "mapped", "pageable_fp8", "mapped_fp8")


def synthetic_steps(args, device: torch.device) -> list[dict]:
    """Forward steps: tokens cycling through args.tokens, split evenly over args.requests new requests."""
    generator = torch.Generator(device=device).manual_seed(0)
    steps = []
    for s in range(args.steps):
        n = args.tokens[s % len(args.tokens)]
        bounds = [n * i // args.requests for i in range(args.requests + 1)]
        positions = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]).to(device)
        states = torch.randn(args.num_aux + 1, n, args.hidden, device=device, dtype=torch.bfloat16,
                             generator=generator)
        steps.append({"req_ids": [f"s{s}r{i}" for i in range(args.requests)],
                      "starts": torch.tensor(bounds, dtype=torch.int32),
                      "token_ids": torch.randint(0, 160_000, (n,), device=device, dtype=torch.int32,
                                                 generator=generator),
                      "positions": positions, "aux": list(states[: args.num_aux]), "final": states[-1]})
    return steps


def fake_worker(device: torch.device, handover: str, num_aux: int, directory: str) -> HiddenStateCapture:
    """The extension as vLLM's worker would hold it after `set_capture_layers`, rank 0."""
    worker = HiddenStateCapture()
    worker.rank, worker._capture_chunks = 0, {}
    worker._capture_layer_ids, worker._capture_handover = tuple(range(num_aux)), handover
    worker._capture_arena = MappedArena(device.type == "cuda", directory) if handover == "mapped" else None
    worker.model_runner = SimpleNamespace(device=device)
    return worker


def record(worker: HiddenStateCapture, step: dict) -> None:
    # the step's batch as `StepBatch.take` reads it from either model runner
    batch = step["req_ids"], step["starts"][: len(step["req_ids"]) + 1].tolist(), step["token_ids"]
    worker._record_step(batch, step["aux"], step["final"], step["positions"])


def outputs_of(steps: list[dict]) -> list[SimpleNamespace]:
    outputs = []
    for step in steps:
        bounds, ids = step["starts"].tolist(), step["token_ids"].tolist()
        outputs += [SimpleNamespace(request_id=r, prompt_token_ids=ids[a:b])
                    for r, a, b in zip(step["req_ids"], bounds, bounds[1:])]
    return outputs


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Forward:
    """A stand-in for the target's forward: bf16 matrix products on the current stream lasting ~`seconds`."""

    def __init__(self, device: torch.device):
        self.device, self.a = device, torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
        self.a @ self.a
        synchronize(device)
        started = time.perf_counter()
        for _ in range(20):
            self.a @ self.a
        synchronize(device)
        self.seconds_per_product = (time.perf_counter() - started) / 20

    def __call__(self, seconds: float) -> None:
        for _ in range(max(1, round(seconds / self.seconds_per_product))):
            self.a @ self.a


def hand_over(worker, steps, variant: str, spool: str, forward: Forward | None, tokens_per_s: float):
    """One pass over `steps`: recorded, handed over, read back. Seconds to hand over and to read."""
    device = steps[0]["final"].device
    synchronize(device)
    started = time.perf_counter()
    for step in steps:
        if forward is not None:
            forward(step["final"].shape[0] / tokens_per_s)
        if variant == "mapped_fp8":
            worker._capture_arena.put(quantize_step(step))
        else:
            record(worker, step)
    if variant == "mapped_fp8":
        worker._capture_arena.wait()
        worker._capture_arena.rewind()
        paths = {}
    else:
        paths = worker.pop_captured(spool)
    synchronize(device)
    handed = time.perf_counter() - started
    started = time.perf_counter()
    if paths:
        captured = load_captured(outputs_of(steps), paths)
        if variant == "pageable_fp8":
            for states in captured:
                quantize_fp8(states["aux_hidden_states"]), quantize_fp8(states["final_hidden_state"])
    return handed, time.perf_counter() - started


def quantize_step(step: dict) -> dict[str, torch.Tensor]:
    """fp8 on the GPU, as `quantize_fp8` stores it: e4m3 values and one float32 scale per token and layer."""
    aux, aux_scale = quantize_fp8(torch.stack(step["aux"], dim=1))
    final, final_scale = quantize_fp8(step["final"])
    return {"token_ids": step["token_ids"].to(torch.int64), "aux": aux, "aux_scale": aux_scale, "final": final,
            "final_scale": final_scale}


def raw_copies(steps: list[dict], directory: str) -> dict:
    """GB/s of one step's states, one device-to-host copy, into pageable, pinned and a mapped slab."""
    states = torch.stack([*steps[0]["aux"], steps[0]["final"]], dim=1)
    nbytes, rates = states.numel() * 2, {}
    try:
        arena = MappedArena(pin=True, directory=directory)
    except RuntimeError as err:
        return {"failed": str(err)}
    pinned = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
    mapping = torch.from_file(os.path.join(directory, "unpinned.bin"), shared=True, size=states.numel(),
                              dtype=states.dtype).view(states.shape)
    targets = {"pageable": lambda: states.cpu(),
               "pinned": lambda: pinned.copy_(states, non_blocking=True),
               "pinned_then_memcpy_to_mapping": lambda: mapping.copy_(pinned.copy_(states)),
               "mapped_slab": lambda: arena.put({"states": states})}
    for name, copy in targets.items():
        try:
            copy()
            arena.wait(), arena.rewind(), synchronize(states.device)
            started = time.perf_counter()
            for _ in range(3):
                copy()
                arena.wait(), arena.rewind(), synchronize(states.device)
            rates[name] = round(3 * nbytes / (time.perf_counter() - started) / 1e9, 2)
        except RuntimeError as err:
            rates[name] = f"failed: {err}"
    return {"bytes": nbytes, "GB_per_s": rates}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 12288, 16384])
    parser.add_argument("--requests", type=int, default=4, help="requests per step")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--num-aux", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timed passes per variant (after one warm-up)")
    parser.add_argument("--forward-tokens-per-s", type=float, nargs="*", default=[60_000.0],
                        help="also time each variant behind synthetic forwards at these prefill rates")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--dir", help="hand-over folder (default: /dev/shm where it has room, else the temp dir)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "capture_handover.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        args.variants = [v for v in args.variants if v in ("pageable", "mapped")]
        args.forward_tokens_per_s = []
    steps = synthetic_steps(args, device)
    tokens = sum(step["final"].shape[0] for step in steps)
    room = 3 * tokens * bytes_per_token(args.num_aux, args.hidden, "bfloat16")
    shm_fits = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > room
    base = args.dir or ("/dev/shm" if shm_fits else None)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "hand_over_dir": base or tempfile.gettempdir(),
              "shape": {"hidden": args.hidden, "num_aux": args.num_aux, "step_tokens": args.tokens,
                        "requests_per_step": args.requests, "steps": args.steps, "tokens": tokens},
              "command": "python -m bench.capture_handover " + " ".join(sys.argv[1:]), "variants": {}}
    if device.type == "cuda":
        with tempfile.TemporaryDirectory(dir=base) as folder:
            result["raw_copy"] = raw_copies(steps, folder)
        print("raw copies:", result["raw_copy"], flush=True)
    forward = Forward(device) if args.forward_tokens_per_s else None
    for variant in args.variants:
        dtype = "fp8" if variant.endswith("fp8") else "bfloat16"
        moved = tokens * (bytes_per_token(args.num_aux, args.hidden, dtype) + 8)  # + the token id
        try:
            result["variants"][variant] = entry = measure(variant, args, steps, tokens, moved, base, device, forward)
        except RuntimeError as err:  # recorded, so that one variant's failure leaves the others' figures
            result["variants"][variant] = entry = {"failed": str(err)}
        print(variant, json.dumps(entry), flush=True)
    result["mapped_equals_pageable"] = same_states(steps, base, args.num_aux)
    print("mapped states equal pageable ones bit for bit:", result["mapped_equals_pageable"], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


def measure(variant: str, args, steps: list[dict], tokens: int, moved: int, base: str | None, device, forward) -> dict:
    with tempfile.TemporaryDirectory(dir=base) as folder:
        handover = "pageable" if variant.startswith("pageable") else "mapped"
        worker = fake_worker(device, handover, args.num_aux, folder)
        hand_over(worker, steps, variant, folder, None, 0)  # warm-up: slabs allocated and page-locked
        runs = [hand_over(worker, steps, variant, folder, None, 0) for _ in range(args.repeats)]
        handed, read = min(r[0] for r in runs), min(r[1] for r in runs)
        entry = {"bytes_handed_over": moved, "hand_over_s": round(handed, 4),
                 "GB_per_s": round(moved / handed / 1e9, 2), "us_per_token": round(handed / tokens * 1e6, 3),
                 "main_process_read_s": round(read, 4),
                 "read_us_per_token": round(read / tokens * 1e6, 3)}
        for rate in args.forward_tokens_per_s if variant != "pageable_fp8" else ():  # its hand-over is pageable's
            forward_only = min(timed_forwards(forward, steps, rate) for _ in range(args.repeats))
            with_capture = min(hand_over(worker, steps, variant, folder, forward, rate)[0]
                               for _ in range(args.repeats))
            entry[f"behind_forward_{rate:.0f}_tok_s"] = {
                "forward_s": round(forward_only, 4), "forward_and_hand_over_s": round(with_capture, 4),
                "exposed_us_per_token": round((with_capture - forward_only) / tokens * 1e6, 3)}
        del worker
    return entry


def same_states(steps: list[dict], base: str | None, num_aux: int) -> bool:
    """Whether both hand-overs give every request the same states, bit for bit."""
    loaded = []
    for handover in ("pageable", "mapped"):
        with tempfile.TemporaryDirectory(dir=base) as folder:
            worker = fake_worker(steps[0]["final"].device, handover, num_aux, folder)
            for step in steps:
                record(worker, step)
            loaded.append(load_captured(outputs_of(steps), worker.pop_captured(folder)))
            del worker
    return all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(*loaded))


def timed_forwards(forward: Forward, steps: list[dict], tokens_per_s: float) -> float:
    synchronize(forward.device)
    started = time.perf_counter()
    for step in steps:
        forward(step["final"].shape[0] / tokens_per_s)
    synchronize(forward.device)
    return time.perf_counter() - started


if __name__ == "__main__":
    main()
