"""Checkpoints: `04_train/checkpoints/step_N/`, complete or absent.

    model.safetensors    the draft's trained tensors and d2t/t2d under speculators' names
                         (`draft_model.reference_state_dict` maps them to the reference export's names)
    optimizer.pt         AdamW state, full (gathered under FSDP) and keyed by parameter name
    scheduler.pt         the learning-rate schedule
    rng-rank<R>.pt       each rank's Python, NumPy and torch RNG states
    trainer_state.json   step and data position (packs consumed, global batch)

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

from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.train.draft_model import FROZEN

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def step_dirs(checkpoints: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    found = [p for p in checkpoints.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def save_checkpoint(checkpoints: Path, step: int, model, optimizer, scheduler, accelerator,
                    packs_per_step: int, keep: int) -> Path:
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
        kept = {name: t.contiguous() for name, t in model_state.items() if name not in FROZEN}
        save_file(kept, str(partial / "model.safetensors"))
        torch.save(optimizer_state, partial / "optimizer.pt")
        torch.save(scheduler.state_dict(), partial / "scheduler.pt")
        state = {"step": step, "packs_consumed": step * packs_per_step, "packs_per_step": packs_per_step}
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
        raise StageError(
            f"{path} was written with a global batch of {state['packs_per_step']} packs per step, this launch has "
            f"{packs_per_step} (processes x micro_batch_size x grad_accumulation): relaunch with as many processes"
        )
    set_model_state_dict(model, load_file(str(path / "model.safetensors")),
                         options=StateDictOptions(full_state_dict=True, strict=False))
    set_optimizer_state_dict(model, optimizer, torch.load(path / "optimizer.pt", weights_only=False),
                             options=StateDictOptions(full_state_dict=True))
    scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))
    _set_rng_state(torch.load(path / f"rng-rank{accelerator.process_index}.pt", weights_only=False))
    return state["step"]


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
        torch.cuda.set_rng_state_all(state["cuda"])
