"""The optimizers of `train.optimizer`: Muon + AdamW acts as one optimizer for the schedule and checkpoints."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from eagle3_pipeline.train import checkpoint
from eagle3_pipeline.train.step import MuonAdamW, lr_schedule, make_optimizer

SINGLE_PROCESS = SimpleNamespace(is_main_process=True, process_index=0, wait_for_everyone=lambda: None)
TRAIN = SimpleNamespace(optimizer="muon", learning_rate=1e-2, muon_weight_decay=0.1, weight_decay=0.0,
                        adam_betas=(0.9, 0.95), warmup_steps=2, max_steps=10, min_lr_ratio=0.1)


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 4, bias=False)
        self.norm = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 5, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.fc(x)))


def steps(model, optimizer, scheduler, count: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        optimizer.zero_grad()
        model(torch.randn(8, 6, generator=generator)).square().mean().backward()
        optimizer.step()
        scheduler.step()


def test_muon_takes_the_matrices_but_lm_head_and_matches_plain_torch_muon():
    model, reference = Tiny(), Tiny()
    optimizer = make_optimizer(model, TRAIN)
    assert isinstance(optimizer, MuonAdamW)
    assert [p for g in optimizer.muon.param_groups for p in g["params"]] == [model.fc.weight]
    assert {id(p) for g in optimizer.adamw.param_groups for p in g["params"]} == \
        {id(model.lm_head.weight), id(model.norm.weight), id(model.norm.bias)}
    # the same update as torch's own Muon and AdamW side by side
    muon = torch.optim.Muon([reference.fc.weight], lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": [reference.lm_head.weight], "weight_decay": 0.0},
                               {"params": [reference.norm.weight, reference.norm.bias], "weight_decay": 0.0}],
                              lr=1e-2, betas=(0.9, 0.95))
    for _ in range(3):
        x = torch.randn(8, 6)
        for m, opts in ((model, [optimizer]), (reference, [muon, adamw])):
            for o in opts:
                o.zero_grad()
            m(x).square().mean().backward()
            for o in opts:
                o.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b)


def test_muon_resumed_from_a_checkpoint_continues_exactly(tmp_path):
    straight = Tiny()
    optimizer = make_optimizer(straight, TRAIN)
    scheduler = lr_schedule(optimizer, TRAIN)
    steps(straight, optimizer, scheduler, 3, seed=1)
    path = checkpoint.save_checkpoint(tmp_path, 3, straight, optimizer, scheduler, SINGLE_PROCESS, 1, keep=1)
    steps(straight, optimizer, scheduler, 3, seed=2)

    resumed = Tiny()
    fresh_optimizer = make_optimizer(resumed, TRAIN)
    fresh_scheduler = lr_schedule(fresh_optimizer, TRAIN)
    assert checkpoint.load_checkpoint(path, resumed, fresh_optimizer, fresh_scheduler, SINGLE_PROCESS, 1) == 3
    assert fresh_optimizer.muon.state is fresh_optimizer.state and fresh_optimizer.muon.param_groups[0]["lr"] > 0
    steps(resumed, fresh_optimizer, fresh_scheduler, 3, seed=2)
    for a, b in zip(straight.parameters(), resumed.parameters()):
        torch.testing.assert_close(a, b)
