"""Checkpoints appear whole or not at all; only the newest `keep` survive."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from eagle3_pipeline.train import checkpoint

SINGLE_PROCESS = SimpleNamespace(is_main_process=True, process_index=0, wait_for_everyone=lambda: None)


def tiny_training_state():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def test_a_save_killed_midway_leaves_no_checkpoint_and_the_next_save_cleans_up(tmp_path, monkeypatch):
    model, optimizer, scheduler = tiny_training_state()

    def save(step: int) -> None:
        checkpoint.save_checkpoint(tmp_path, step, model, optimizer, scheduler, SINGLE_PROCESS, 2, keep=2)

    save(1)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "save_file", lambda *args: (_ for _ in ()).throw(OSError("disk full")))
        with pytest.raises(OSError):
            save(2)
    assert [p.name for p in checkpoint.step_dirs(tmp_path)] == ["step_1"]
    assert (tmp_path / ".step_2.partial").is_dir()

    save(3)
    save(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]  # partial gone, keep=2


def test_load_restores_what_was_saved_and_refuses_another_global_batch(tmp_path):
    from eagle3_pipeline.stage_io import StageError

    model, optimizer, scheduler = tiny_training_state()
    path = checkpoint.save_checkpoint(tmp_path, 7, model, optimizer, scheduler, SINGLE_PROCESS, 2, keep=1)
    fresh_model, fresh_optimizer, fresh_scheduler = tiny_training_state()
    step = checkpoint.load_checkpoint(path, fresh_model, fresh_optimizer, fresh_scheduler, SINGLE_PROCESS, 2)
    assert step == 7 and torch.equal(fresh_model.weight, model.weight)
    moments = [opt.state_dict()["state"][0]["exp_avg"] for opt in (fresh_optimizer, optimizer)]
    assert torch.equal(*moments)
    with pytest.raises(StageError, match="global batch of 2 packs per step, this launch has 4"):
        checkpoint.load_checkpoint(path, fresh_model, fresh_optimizer, fresh_scheduler, SINGLE_PROCESS, 4)
