"""One optimizer step of the draft, with the optimizer and schedule it uses (04_train and the benchmark).

The loss of a step is the mean over its micro-batches of each packed row's TTT loss (draft_model.py): each
micro-batch's loss is divided by the accumulation count, and DDP averages gradients over processes, so
P processes x A micro-batches give the same step as 1 process x P*A micro-batches on the same packs.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist

FLOAT_INPUTS = ("aux", "final")


def make_optimizer(model: torch.nn.Module, train) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, norm scales (1-D) not decayed; with `train.optimizer` muon, Muon
    over the 2-D weights but lm_head (`train` is a TrainConfig)."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    matrices = [p for name, p in named if p.ndim == 2 and "lm_head" not in name]
    fused = next(model.parameters()).is_cuda  # one kernel for all parameters on GPU
    if train.optimizer == "muon":
        rest = [p for _, p in named if all(p is not m for m in matrices)]
        return MuonAdamW(matrices, rest, train)
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": train.weight_decay},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=train.learning_rate, betas=tuple(train.adam_betas), fused=fused)


class MuonAdamW(torch.optim.Optimizer):
    """torch.optim.Muon on `matrices`, AdamW on `rest`, as one optimizer: the schedule, accelerate and the
    checkpoints see one set of parameter groups (the two optimizers' own, shared) and one state.

    Under DDP with several processes every rank holds the same averaged gradients, so Muon's Newton-Schulz
    iterations (most of its cost) would be repeated on each: instead each matrix is orthogonalised by one rank
    (`matrix_owners`) and broadcast from it. The result is the same as one process's; each matrix's momentum
    lives on its owner until `state_dict` gathers it."""

    def __init__(self, matrices: list[torch.nn.Parameter], rest: list[torch.nn.Parameter], train):
        # match_rms_adamw scales Muon's orthogonalised update to AdamW's RMS: one learning rate serves both
        self.muon = torch.optim.Muon(matrices, lr=train.learning_rate, weight_decay=train.muon_weight_decay,
                                     adjust_lr_fn="match_rms_adamw")
        groups = [{"params": [p for p in rest if p.ndim >= 2], "weight_decay": train.weight_decay},  # lm_head
                  {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}]
        self.adamw = torch.optim.AdamW([g for g in groups if g["params"]], lr=train.learning_rate,
                                       betas=tuple(train.adam_betas))
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._share()

    def _share(self) -> None:
        split = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:split], self.param_groups[split:]
        self.muon.state = self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces the groups and the state: share them again
        self._share()

    def _matrices(self) -> list[torch.nn.Parameter]:
        return [p for group in self.muon.param_groups for p in group["params"]]

    @staticmethod
    def _owners(matrices: list[torch.nn.Parameter]) -> list[int] | None:
        """The rank that orthogonalises each matrix, or None where this process does them all (one process, or
        FSDP, whose sharded matrices torch's Muon orthogonalises as DTensors)."""
        from torch.distributed.tensor import DTensor

        if not (dist.is_initialized() and dist.get_world_size() > 1) or any(isinstance(p, DTensor) for p in matrices):
            return None
        return matrix_owners([tuple(p.shape) for p in matrices], dist.get_world_size())

    @torch.no_grad()
    def step(self, closure=None):
        matrices = self._matrices()
        owners = self._owners(matrices)
        if owners is None:
            self.muon.step()
        else:
            rank = dist.get_rank()
            others = {p: p.grad for p, owner in zip(matrices, owners) if owner != rank}
            for p in others:
                p.grad = None  # torch's Muon skips a parameter without a gradient
            self.muon.step()
            for p, grad in others.items():
                p.grad = grad
            works = [dist.broadcast(p.data, src=owner, async_op=True) for p, owner in zip(matrices, owners)]
            for work in works:
                work.wait()
        self.adamw.step()

    def state_dict(self) -> dict:
        """The whole state on every rank: under DDP each matrix's momentum is first broadcast from its owner (a
        collective: every rank calls it, as checkpoint.save_checkpoint does)."""
        matrices = self._matrices()
        for p, owner in zip(matrices, self._owners(matrices) or []):
            momentum = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
            dist.broadcast(momentum, src=owner)
        return super().state_dict()


def matrix_owners(shapes: list[tuple[int, int]], world_size: int) -> list[int]:
    """A rank per matrix, balancing Newton-Schulz cost (min(m, n)^2 x max(m, n) per iteration): the costliest
    first, each to the least loaded rank (the lowest on a tie), so every rank computes the same answer."""
    costs = [min(shape) ** 2 * max(shape) for shape in shapes]
    load = [0] * world_size
    owners = [0] * len(shapes)
    for i in sorted(range(len(shapes)), key=lambda i: -costs[i]):
        owners[i] = min(range(world_size), key=load.__getitem__)
        load[owners[i]] += costs[i]
    return owners


def lr_schedule(optimizer: torch.optim.Optimizer, train) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup to the peak, then cosine decay to min_lr_ratio x peak at max_steps."""

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps)
        return train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def to_device(batch: dict[str, torch.Tensor], device: torch.device, float_dtype: torch.dtype) -> dict:
    """Move a collated batch; hidden states in `float_dtype` (fp32 without autocast, bf16 storage with it)."""
    return {name: t.to(device, dtype=float_dtype if name in FLOAT_INPUTS else None, non_blocking=True)
            for name, t in batch.items()}


def train_step(model, optimizer, scheduler, micro_batches: list[dict], accelerator, ttt_steps: int,
               step_weights: list[float], grad_clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward/backward every micro-batch, clip, step. Returns (per-step stats summed, gradient norm)."""
    optimizer.zero_grad(set_to_none=True)
    stats = 0
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        # Gradients are all-reduced once per step, on the last micro-batch.
        with contextlib.nullcontext() if last else accelerator.no_sync(model):
            loss, batch_stats, _ = model(**batch, ttt_steps=ttt_steps, step_weights=step_weights)
            accelerator.backward(loss / len(micro_batches))
        stats = stats + batch_stats.detach()
    grad_norm = accelerator.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    return stats, grad_norm
