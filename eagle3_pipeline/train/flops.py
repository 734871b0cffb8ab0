"""FLOPs of one training step of the draft, and model FLOPs utilisation (MFU) on GPUs we know the peak of.

Counted: matrix products only (norms, rope, softmax and the loss are a few percent and not counted), 2 FLOPs
per multiply-add. Per token (row) of a packed batch, with K = ttt_steps:

    fc        n_aux*H x H          forward 2P + weight gradient 2P (its input is data: no input gradient)
    layer     q,k,v: 2H x (heads|kv_heads)*head_dim, o: heads*head_dim x H, mlp: 3 x H x I
              forward 2P + input gradient 2P + weight gradient 2P, once per TTT step
    lm_head   H x draft_vocab      as the layer when trained (ours); 4P when frozen (speculators freezes it)
    verifier  H x draft_vocab      forward 2P, once (the targets)
    attention per step and query: QK^T and PV over the keys it reads, 4 x heads*head_dim per key forward
              (MLA: 2 x heads x (qk_head_dim + v_head_dim)), x3 with backward; keys read = its document prefix
              + one own entry per earlier step
    MLA       q_a, q_b, kv_a, kv_b, o in the layer; step k also re-expands the k earlier steps' latents
              through kv_b (the training forward caches latents, not keys and values)

For the Kimi draft (H 7168, 64 x 128 heads, I 18432, vocab 32000, 3 aux layers) at K = 3 this is about
20 GFLOP per token plus attention, so one H200 (989 TFLOP/s dense bf16) tops out near 40-50k tokens/s.
"""

from __future__ import annotations

import torch

from eagle3_pipeline.draft_spec import (attention_multiply_adds_per_key, latent_expansion_multiply_adds,
                                        layer_multiply_adds)

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}  # dense, per GPU (vendor figures)


def train_flops(draft, num_aux: int, ttt_steps: int, tokens: int, attended_keys: int,
                lm_head_trained: bool = True) -> float:
    """FLOPs of one optimizer step over `tokens` rows reading `attended_keys` keys in all (see above)."""
    h, head = draft.hidden_size, draft.hidden_size * draft.draft_vocab_size
    per_token = 4 * num_aux * h * h
    per_token += ttt_steps * (6 * layer_multiply_adds(draft) + (6 if lm_head_trained else 4) * head)
    per_token += 2 * head
    # MLA: each step expands the latents of the earlier steps' entries again (kv_b_proj), fwd + both grads
    per_token += 6 * ttt_steps * (ttt_steps - 1) // 2 * latent_expansion_multiply_adds(draft)
    attention = 3 * 2 * attention_multiply_adds_per_key(draft) * attended_keys
    return per_token * tokens + attention


def attended_keys(document_ids: torch.Tensor, ttt_steps: int) -> int:
    """Keys read by all queries of all TTT steps, for packed rows with these document ids [B, L] (-1: pad)."""
    row = torch.arange(document_ids.shape[0], device=document_ids.device)[:, None]
    per_document = torch.bincount((row * document_ids.shape[1] + document_ids)[document_ids >= 0])
    prefix = int((per_document * (per_document + 1) // 2).sum())  # causal: a document's i-th row reads i keys
    tokens = int(per_document.sum())
    return ttt_steps * prefix + tokens * ttt_steps * (ttt_steps - 1) // 2


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of one GPU of this kind, or None (CPU, unknown GPU: no MFU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_FLOPS.items() if key in name), None)
