"""Checkpoints: `04_train/checkpoints/step_N/`, complete or absent.

    model.safetensors    the draft's trained tensors and d2t/t2d under speculators' names
                         (`export.format.export_state_dict` maps them to the reference export's names)
    optimizer.pt         AdamW state, full (gathered under FSDP) and keyed by parameter name
    scheduler.pt         the learning-rate schedule
    rng-rank<R>.pt       each rank's Python, NumPy and torch RNG states
    trainer_state.json   step and data position (packs consumed, global batch), and how the launch split
                         the global batch (processes x micro_batch_size x grad_accumulation)

A checkpoint resumes under any split of the same global batch (2 GPUs x grad_accumulation 1 -> 1 GPU x
grad_accumulation 2, and back): the packs of each step, the summed gradient and therefore the run are the same.
`adopt_split` lets the stage's partial work continue under the new micro_batch_size/grad_accumulation; every
rank's RNG state is the same (one seed, no random ops in a step), so a rank the writer did not have takes rank 0's.

All ranks write into `.step_N.partial/`; rank 0 renames it to `step_N` once every file is there, so a crash
mid-save leaves only a hidden partial folder, which is never resumed from and which the next save deletes.
The frozen verifier tensors are not saved: they are read from the target again at start-up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from eagle3_pipeline.draft_spec import stored_tensors
from eagle3_pipeline.stage_io import STARTED, Stage, StageError, config_values, fingerprint, write_json_atomic

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def step_dirs(checkpoints: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = [p for p in checkpoints.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def save_checkpoint(checkpoints: Path, step: int, model, optimizer, scheduler, accelerator,
                    packs_per_step: int, keep: int, split: dict | None = None) -> Path:
    final = checkpoints / f"step_{step}"
    partial = checkpoints / f".step_{step}.partial"
    if accelerator.is_main_process:
        for stale in checkpoints.glob(".step_*.partial"):  # left by a save that was killed
            shutil.rmtree(stale)
        partial.mkdir(parents=True)
    accelerator.wait_for_everyone()
    # Gathering is collective (FSDP): every rank takes part, rank 0 writes.
    model_state = get_model_state_dict(model, options=FULL)
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    torch.save(_rng_state(), partial / f"rng-rank{accelerator.process_index}.pt")
    if accelerator.is_main_process:
        kept = {name: t.contiguous() for name, t in stored_tensors(model_state).items()}
        save_file(kept, str(partial / "model.safetensors"))
        torch.save(optimizer_state, partial / "optimizer.pt")
        torch.save(scheduler.state_dict(), partial / "scheduler.pt")
        state = {"step": step, "packs_consumed": step * packs_per_step, "packs_per_step": packs_per_step,
                 **(split or {})}  # split: processes, micro_batch_size, grad_accumulation of this launch
        (partial / "trainer_state.json").write_text(json.dumps(state, indent=2) + "\n")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in step_dirs(checkpoints)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load_checkpoint(path: Path, model, optimizer, scheduler, accelerator, packs_per_step: int) -> int:
    """Restore everything saved in `path`; returns the step to continue from."""
    state = json.loads((path / "trainer_state.json").read_text())
    if state["packs_per_step"] != packs_per_step:
        raise StageError(_other_batch(path, state["packs_per_step"], packs_per_step))
    set_model_state_dict(model, load_file(str(path / "model.safetensors")),
                         options=StateDictOptions(full_state_dict=True, strict=False))
    set_optimizer_state_dict(model, optimizer, torch.load(path / "optimizer.pt", weights_only=False),
                             options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    rng = path / f"rng-rank{accelerator.process_index}.pt"
    if not rng.is_file():  # more processes than the writer had: all ranks' states are equal (see top)
        rng = path / "rng-rank0.pt"
    _set_rng_state(torch.load(rng, weights_only=False))
    return state["step"]


def adopt_split(stage: Stage, packs_per_step: int) -> None:
    """Before `stage.begin()` on --resume: partial work launched with another micro_batch_size/grad_accumulation
    (another process count) continues when the global batch is the same and nothing else in the config changed.

    Stage.begin refuses partial work whose `.started.json` fingerprint differs from this launch's. The newest
    checkpoint records the split it was written with; when this launch's config with that split has exactly the
    recorded fingerprint, the only change is the split, and the record is moved to this launch's config (the
    finished stage's manifest holds the config of the launch that finished it).
    """
    started, found = stage.dir / STARTED, step_dirs(stage.path("checkpoints"))
    if not started.is_file() or not found:
        return
    recorded = json.loads(started.read_text())
    state = json.loads((found[-1] / "trainer_state.json").read_text())
    split = {key: state[key] for key in ("micro_batch_size", "grad_accumulation") if key in state}
    if recorded.get("fingerprint") == stage.fingerprint or len(split) < 2:  # same config, or an older checkpoint
        return
    sections = config_values(stage.resolved, stage.spec.sections)  # 04's are whole sections, train among them
    sections["train"] = sections["train"] | split  # a new dict: stage.resolved stays as loaded
    if fingerprint(sections) != recorded.get("fingerprint"):
        return  # something besides the split changed: Stage.begin refuses, as for any other config change
    if state["packs_per_step"] != packs_per_step:
        raise StageError(_other_batch(found[-1], state["packs_per_step"], packs_per_step))
    write_json_atomic(started, {**recorded, "fingerprint": stage.fingerprint, "config": stage.resolved})
    print(f"04_train: resuming {found[-1].name}, written by {state.get('processes', '?')} process(es) x "
          f"micro_batch_size {state['micro_batch_size']} x grad_accumulation {state['grad_accumulation']}, with "
          f"another split of the same global batch ({packs_per_step} packs per step)")


def _other_batch(path: Path, written: int, now: int) -> str:
    return (f"{path} was written with a global batch of {written} packs per step, this launch has {now} "
            f"(processes x micro_batch_size x grad_accumulation): keep the product, e.g. "
            f"--set train.grad_accumulation=N with N x processes x micro_batch_size = {written}")


def _rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        for device, cuda_state in enumerate(state["cuda"][:torch.cuda.device_count()]):  # a node with fewer GPUs
            torch.cuda.set_rng_state(cuda_state, device)
