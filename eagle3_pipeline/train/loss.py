"""The draft head and the distillation loss fused and chunked (`train.loss_chunk_rows`).

The plain computation of a TTT step materialises the draft's logits [rows, draft vocab] in float32, their
log-softmax for the backward, and the verifier's probabilities beside them. `chunked_head_kl` takes the
pre-head hidden states instead and works through `chunk_rows` rows at a time: logits, forward KL against
the verifier, and the gradients of the head's input and weight (d loss / d logits = row weight x
(softmax(draft) - softmax(verifier))) are computed in the forward pass, so only one chunk's [chunk, vocab]
float32 tensors exist at once; the backward scales the stored gradients by the incoming one. The matrix
products run in the autocast dtype when autocast is on; softmax, KL and the weight gradient's sum over chunks
in float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunked_head_kl(hidden: torch.Tensor, weight: torch.Tensor, target_logits: torch.Tensor,
                    row_weight: torch.Tensor, chunk_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """sum_r row_weight[r] * KL(softmax(target_logits[r]) || softmax(hidden[r] @ weight.T)).

    hidden [N, H], weight [V, H], target_logits [N, V], row_weight [N] (float32). Returns (the weighted
    loss, which carries gradients to hidden and weight; KL per row [N]; the draft's argmax per row [N]).
    """
    return _ChunkedHeadKL.apply(hidden, weight, target_logits, row_weight, chunk_rows)


class _ChunkedHeadKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target_logits, row_weight, chunk_rows):
        exact = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 for float64 inputs
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=exact)
        kl = hidden.new_empty(hidden.shape[0], dtype=exact)
        top1 = torch.empty(hidden.shape[0], dtype=torch.long, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            chunk = hidden[rows]
            products = chunk @ weight.T  # in the autocast dtype when autocast is on
            logits = products.to(exact)
            log_q = F.log_softmax(logits, dim=-1)
            log_p = F.log_softmax(target_logits[rows].to(exact), dim=-1)
            p = log_p.exp()
            kl[rows] = (p * (log_p - log_q)).sum(-1)
            top1[rows] = logits.argmax(-1)
            grad_logits = ((log_q.exp() - p) * row_weight[rows, None]).to(products.dtype)
            grad_hidden[rows] = (grad_logits @ weight).to(hidden.dtype)
            grad_weight += (grad_logits.T @ chunk).to(exact)
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        ctx.mark_non_differentiable(kl, top1)
        return (kl * row_weight).sum(), kl, top1

    @staticmethod
    def backward(ctx, grad_loss, _grad_kl, _grad_top1):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype), \
            None, None, None
