"""Attention of the training-time-test (TTT) unroll: which keys each query of step k may read.

A packed row holds several documents; `document_ids[t]` says which (-1 for padding). Each TTT step appends
one key/value per row to the cache, so at step k the keys are k + 1 blocks of L (the packed length):

    block 0 (step-0 entries)      row t reads rows t' <= t of its own document
    block j = 1..k                row t reads only its own step-j entry (column t of the block)

This is what vLLM's draft reads when serving: at draft step k for a context ending at position t, its KV
cache holds the step-0 entries of the verified prefix (positions <= t, written from the target's hidden
states) plus the entries the earlier draft steps of this round wrote (positions t+1 .. t+k), its own
included. Training computes that for every t at once.

Backends (`train.attention`): `flex` builds a BlockMask for torch's flex attention, compiled once, and costs
only the blocks the mask keeps (GPU); `sdpa` and `eager` take a dense [B, 1, L, (k+1)L] mask (CPU, tests).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE, BlockMask, create_block_mask, flex_attention
from transformers import AttentionInterface

FLEX = "eagle3_ttt_flex"  # the name our compiled flex attention is registered under in transformers


def resolve_attention(choice: str, device: torch.device) -> str:
    """The transformers attention implementation for `train.attention` on this device."""
    if choice == "auto":
        choice = "flex" if device.type == "cuda" else "sdpa"
    if choice == "flex":
        _register_compiled_flex()
        return FLEX
    return choice


def ttt_masks(document_ids: torch.Tensor, ttt_steps: int, implementation: str) -> list:
    """One attention mask per TTT step for a batch of packed rows (`document_ids` [B, L])."""
    if implementation == FLEX:
        if document_ids.shape[1] % _DEFAULT_SPARSE_BLOCK_SIZE:
            return [_block_mask(document_ids, step) for step in range(ttt_steps)]
        masks = [_block_mask(document_ids, 0)]
        for _ in range(1, ttt_steps):
            masks.append(_extend_block_mask(masks[-1]))
        return masks
    masks = [_dense_mask(document_ids, step) for step in range(ttt_steps)]
    if implementation == "eager":  # eager attention adds the mask to the scores: 0 keeps, -inf drops
        return [torch.zeros(m.shape, device=m.device).masked_fill_(~m, float("-inf")) for m in masks]
    return masks


def _dense_mask(document_ids: torch.Tensor, step: int) -> torch.Tensor:
    rows = torch.arange(document_ids.shape[1], device=document_ids.device)
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    step0 = same_document & (rows[None, :, None] >= rows[None, None, :])  # [B, L, L]
    own_entry = (rows[:, None] == rows[None, :]).expand_as(step0)
    return torch.cat([step0, *[own_entry] * step], dim=-1).unsqueeze(1)  # [B, 1, L, (step+1) L]


def _block_mask(document_ids: torch.Tensor, step: int) -> BlockMask:
    batch, length = document_ids.shape

    def keep(b, h, q, kv):
        column = kv % length
        step0 = (kv < length) & (document_ids[b, q] == document_ids[b, column]) & (column <= q)
        return step0 | ((kv >= length) & (column == q))

    return create_block_mask(keep, B=batch, H=None, Q_LEN=length, KV_LEN=(step + 1) * length,
                             device=document_ids.device)


def _extend_block_mask(mask: BlockMask) -> BlockMask:
    """`mask` plus the next step's KV blocks, of which each query block reads only its own (diagonal) one.

    What speculators' `extend_mask_for_draft_tokens` does for a batch of one, for any batch: no mask function
    is evaluated again, only the block lists grow.
    """
    counts, indices = mask.kv_num_blocks, mask.kv_indices  # [B, H, Q blocks], [B, H, Q blocks, KV blocks]
    query_blocks, kv_blocks = indices.shape[-2:]
    indices = torch.cat([indices, indices.new_zeros(*indices.shape[:-1], query_blocks)], dim=-1)
    own_block = kv_blocks + torch.arange(query_blocks, device=indices.device, dtype=indices.dtype)
    indices.scatter_(-1, counts.unsqueeze(-1).long(), own_block.expand_as(counts).unsqueeze(-1))
    full = mask.full_kv_indices
    if full is not None:  # the new blocks are partial: the full-block lists only widen
        full = torch.cat([full, full.new_zeros(*full.shape[:-1], query_blocks)], dim=-1)
    return BlockMask.from_kv_blocks(counts + 1, indices, mask.full_kv_num_blocks, full,
                                    BLOCK_SIZE=mask.BLOCK_SIZE, mask_mod=mask.mask_mod)


_compiled_flex_attention = None


def _flex_attention_forward(module, query, key, value, attention_mask: BlockMask, scaling=None, **_):
    """transformers' attention signature over compiled flex attention; returns [B, L, heads, head_dim]."""
    out = _compiled_flex_attention(query, key, value, block_mask=attention_mask, scale=scaling,
                                   enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def _register_compiled_flex() -> None:
    # Uncompiled, flex attention materialises every score: compiling it is what makes it a fused kernel.
    global _compiled_flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
        AttentionInterface.register(FLEX, _flex_attention_forward)
