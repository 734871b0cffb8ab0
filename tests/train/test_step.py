"""The optimizers of `train.optimizer`: Muon + AdamW acts as one optimizer for the schedule and checkpoints, and
under DDP its ranks split Muon's matrices."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from eagle3_pipeline.train import checkpoint
from eagle3_pipeline.train.step import MuonAdamW, lr_schedule, make_optimizer, matrix_owners
from tests.mooncake_master import free_port

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


class TwoMatrices(Tiny):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        return self.lm_head(self.norm(self.proj(self.fc(x))))


def ddp_rank(rank: int, world_size: int, port: int, out: str) -> None:
    """One of `world_size` gloo processes: 3 Muon steps on the gradients every rank holds after DDP's all-reduce,
    then which matrices' momentum this rank computed and the state_dict a checkpoint takes."""
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                         world_size=world_size)
    try:
        model = TwoMatrices()
        optimizer = make_optimizer(model, TRAIN)
        steps(model, optimizer, lr_schedule(optimizer, TRAIN), 3, seed=1)
        computed = [i for i, p in enumerate(optimizer._matrices()) if "momentum_buffer" in optimizer.state[p]]
        torch.save({"computed": computed, "state": optimizer.state_dict(),
                    "params": [p.detach().clone() for p in model.parameters()]}, f"{out}/rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def test_ddp_ranks_split_muons_matrices_and_end_where_one_process_does(tmp_path):
    assert matrix_owners([(4, 6), (4, 4)], 3) == [0, 1]  # fc costs 4^2 x 6, proj 4^2 x 4: rank 2 has none
    assert matrix_owners([(8, 8), (2, 8), (2, 8), (4, 8)], 2) == [0, 1, 1, 1]
    torch.multiprocessing.spawn(ddp_rank, args=(3, free_port(), str(tmp_path)), nprocs=3)

    model = TwoMatrices()
    optimizer = make_optimizer(model, TRAIN)
    steps(model, optimizer, lr_schedule(optimizer, TRAIN), 3, seed=1)
    whole = optimizer.state_dict()
    for rank, computed in enumerate([[0], [1], []]):
        saved = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert saved["computed"] == computed
        for got, want in zip(saved["params"], model.parameters()):
            torch.testing.assert_close(got, want)
        for index, state in whole["state"].items():  # momentum (gathered) and AdamW's moments
            for key, value in state.items():
                torch.testing.assert_close(saved["state"]["state"][index][key], value)
