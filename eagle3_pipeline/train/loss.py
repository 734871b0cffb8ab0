"""The distillation loss of a TTT step (`train.loss`), and the draft head fused with it, chunked.

Per counted row, with p the verifier's distribution and q the draft's (softmax over the draft vocab), the
acceptance rate of a draft token under speculative sampling is alpha = sum_i min(p_i, q_i) = 1 - TV(p, q):

    kl        KL(p || q)
    tv        TV(p, q) = 1 - alpha                         speculators: src/speculators/losses/eager.py, tv_loss
    lk        lambda KL + (1 - lambda) TV, lambda = exp(-eta alpha), alpha in lambda not differentiated
              (eta: `train.lk_eta`): LK^lambda of Samarin et al., "LK Losses: Direct Acceptance Rate
              Optimization for Speculative Decoding" (arXiv 2602.23881), per row as speculators ships it
              (losses/eager.py, lk_hybrid_loss; eta 3.0, by its account the paper's best) and TorchSpec's PR #29
              (torchspec/models/ops/loss.py, compiled_lk_lambda_loss). SpecForge's lk_loss_type "lambda"
              (specforge/core/lk_loss.py) blends the batch means instead, weight kl_scale exp(-kl_decay alpha).
    lk_alpha  -log alpha (alpha floored at 1e-5): LK^alpha, speculators' neg_log_acceptance_loss (eager.py);
              SpecForge's lk_loss_type "alpha" (specforge/core/lk_loss.py)

KL weighs all of p's mass, also what a small draft cannot cover; TV and -log alpha count only the overlap,
which is what speculative sampling accepts. TV's gradient vanishes where the overlap is small (a cold
start): lk leans on KL there, lk_alpha scales TV's gradient by 1 / alpha. p is renormalised over the draft
vocab, as speculators and TorchSpec take it (the verifier head holds only the draft vocab's rows), so alpha
here is at least the served acceptance rate, whose p keeps the mass of the tokens outside the draft vocab.

`chunked_head_loss` (`train.loss_chunk_rows`): the plain computation of a TTT step materialises the draft's
logits [rows, draft vocab] in float32, their softmax for the backward, and the verifier's probabilities beside
them. `chunked_head_loss` takes the pre-head hidden states instead and works through `chunk_rows` rows at a
time: logits, the loss against the verifier, and the gradients of the head's input and weight are computed
in the forward pass, so only one chunk's [chunk, vocab] float32 tensors exist at once; the backward scales
the stored gradients by the incoming one. The gradient of a row's loss L(KL, alpha) by the logits z:

    d KL / d z    = q - p
    d alpha / d z = q * (g - sum_i g_i q_i),  g_i = 1 where q_i < p_i, else 0 (softmax's Jacobian applied
                    to d alpha / d q = g; a tie q_i = p_i, where torch.minimum splits the gradient, is
                    one where both are 0 in float, contributing nothing, or has measure zero)
    d L / d z     = (dL/dKL) (q - p) + (dL/dalpha) d alpha / d z   (`Objective.partials`)

The matrix products run in the autocast dtype when autocast is on; softmax, the loss and the weight
gradient's sum over chunks in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

LOSSES = {"kl": "forward KL(p || q)", "tv": "TV(p, q) = 1 - alpha",  # `train.loss`: what the train log prints
          "lk": "LK^lambda = lambda KL + (1 - lambda) TV, lambda = exp(-eta alpha)", "lk_alpha": "LK^alpha = -log alpha"}
ALPHA_FLOOR = 1e-5  # lk_alpha: -log of a vanishing overlap stays finite (speculators' _NLA_EPS)


@dataclass(frozen=True)
class Objective:
    """`train.loss` and its hyper-parameter: the loss of a row from its KL and its acceptance rate alpha."""

    name: str = "kl"
    lk_eta: float = 3.0

    def __post_init__(self):
        if self.name not in LOSSES:
            raise ValueError(f"unknown loss {self.name!r}: one of {', '.join(LOSSES)}")

    @property
    def needs_alpha(self) -> bool:
        return self.name != "kl"

    def row_loss(self, kl: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
        """The loss per row; differentiable through `kl` and `alpha` (lambda of lk is not)."""
        if self.name == "kl":
            return kl
        if self.name == "tv":
            return 1 - alpha
        if self.name == "lk":
            blend = torch.exp(-self.lk_eta * alpha.detach())
            return blend * kl + (1 - blend) * (1 - alpha)
        return -torch.log(alpha.clamp(min=ALPHA_FLOOR))

    def partials(self, alpha: torch.Tensor) -> tuple[torch.Tensor | float, torch.Tensor | float]:
        """(d row_loss / d KL, d row_loss / d alpha) per row [N, 1] (or constants), for the losses that read alpha."""
        if self.name == "tv":
            return 0.0, -1.0
        alpha = alpha[:, None]
        if self.name == "lk":
            blend = torch.exp(-self.lk_eta * alpha)
            return blend, blend - 1
        return 0.0, torch.where(alpha > ALPHA_FLOOR, -1 / alpha, 0.0)


FORWARD_KL = Objective()  # the default


def acceptance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """alpha = sum_i min(p_i, q_i) per row: the chance speculative sampling accepts a token drawn from q."""
    return torch.minimum(p, q).sum(-1)


def chunked_head_loss(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor,
                      row_weight: torch.Tensor, chunk_rows: int, objective: Objective = FORWARD_KL
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum_r row_weight[r] * objective's loss(softmax(target_logits[r]), softmax(hidden[r] @ weight.T)).

    hidden [N, H], weight [V, H], target_logits [N, V], row_weight [N] (float32). Returns (the weighted
    loss, which carries gradients to hidden and weight; the loss per row [N]; KL per row [N]; the draft's
    argmax per row [N]).
    """
    return _ChunkedHeadLoss.apply(hidden, weight, target_logits, row_weight, chunk_rows, objective)


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target_logits, row_weight, chunk_rows, objective):
        exact = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for float64 inputs
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=exact)
        row_loss = hidden.new_empty(hidden.shape[0], dtype=exact)
        kl = torch.empty_like(row_loss)
        top1 = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            chunk = hidden[rows]
            products = chunk @ weight.T  # in the autocast dtype when autocast is on
            logits = products.to(exact)
            log_q = F.log_softmax(logits, dim=-1)
            log_p = F.log_softmax(target_logits[rows].to(exact), dim=-1)
            p, q = log_p.exp(), log_q.exp()
            kl[rows] = (p * (log_p - log_q)).sum(-1)
            top1[rows] = logits.argmax(-1)
            alpha = acceptance(p, q) if objective.needs_alpha else None
            row_loss[rows] = objective.row_loss(kl[rows], alpha)
            grad_logits = _logit_grad(objective, p, q, alpha) * row_weight[rows, None]
            grad_logits = grad_logits.to(products.dtype)
            grad_hidden[rows] = (grad_logits @ weight).to(hidden.dtype)
            grad_weight += (grad_logits.T @ chunk).to(exact)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(row_loss, kl, top1)
        return (row_loss * row_weight).sum(), row_loss, kl, top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_row_loss, _grad_kl, _grad_top1):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype), \
            None, None, None, None


def _logit_grad(objective: Objective, p: torch.Tensor, q: torch.Tensor, alpha: torch.Tensor | None) -> torch.Tensor:
    """d row_loss / d logits [chunk, V] (the module docstring derives it)."""
    if not objective.needs_alpha:
        return q - p
    by_kl, by_alpha = objective.partials(alpha)
    below = (q < p).to(q.dtype)
    alpha_grad = q * (below - (below * q).sum(-1, keepdim=True))
    return by_kl * (q - p) + by_alpha * alpha_grad
