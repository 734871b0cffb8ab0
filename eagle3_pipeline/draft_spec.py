"""The draft described once (04, 05, 06): every tensor's name and shape under the training draft's names, which
of them are the target's frozen copies, and the matrices a token multiplies through. The model 04 builds is held
to these shapes (tests/train/test_draft_model.py), 05's export config and spec follow from them
(export/format.py), and so does the FLOP count of a training step (train/flops.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from eagle3_pipeline.config_sections import DraftConfig

LAYER = "layers.0."
# The verifier's tensors the draft holds frozen during training; no export stores them (vLLM shares the target's).
FROZEN = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")
# the decoder layer's matrices, which every token of every TTT step multiplies through
LAYER_MATRICES = tuple(LAYER + name for name in (
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"))


def floating_shapes(draft: DraftConfig, num_aux: int, target_vocab: int) -> dict[str, list[int]]:
    """{name: shape} of the draft's floating tensors, frozen verifier tensors included."""
    hidden, heads, kv_heads = draft.hidden_size, draft.num_attention_heads, draft.num_key_value_heads
    return {
        "embed_tokens.weight": [target_vocab, hidden],
        "fc.weight": [hidden, num_aux * hidden],
        # the layer's attention reads [embedding | hidden state]: twice the hidden size
        LAYER + "self_attn.q_proj.weight": [heads * draft.head_dim, 2 * hidden],
        LAYER + "self_attn.k_proj.weight": [kv_heads * draft.head_dim, 2 * hidden],
        LAYER + "self_attn.v_proj.weight": [kv_heads * draft.head_dim, 2 * hidden],
        LAYER + "self_attn.o_proj.weight": [hidden, heads * draft.head_dim],
        LAYER + "mlp.gate_proj.weight": [draft.intermediate_size, hidden],
        LAYER + "mlp.up_proj.weight": [draft.intermediate_size, hidden],
        LAYER + "mlp.down_proj.weight": [hidden, draft.intermediate_size],
        LAYER + "input_layernorm.weight": [hidden],
        LAYER + "hidden_norm.weight": [hidden],
        LAYER + "post_attention_layernorm.weight": [hidden],
        "norm.weight": [hidden],
        "lm_head.weight": [draft.draft_vocab_size, hidden],
        "verifier_norm.weight": [hidden],
        "verifier_lm_head.weight": [draft.draft_vocab_size, hidden],
        **({"input_norm.weight": [num_aux * hidden]} if draft.norm_before_fc else {}),
        **{f"fc_norm.{i}.weight": [hidden] for i in range(num_aux) if draft.fc_norm},
    }


def vocab_map_shapes(draft: DraftConfig, target_vocab: int) -> dict[str, tuple[list[int], str]]:
    """The vocabulary maps 03 builds: d2t (draft id -> target id offset) and t2d (target id -> in the draft)."""
    return {"d2t": ([draft.draft_vocab_size], "int64"), "t2d": ([target_vocab], "bool")}


def layer_multiply_adds(draft: DraftConfig) -> int:
    """Multiply-adds per token through the decoder layer's matrices."""
    shapes = floating_shapes(draft, 1, 1)
    return sum(math.prod(shapes[name]) for name in LAYER_MATRICES)


def stored_tensors(draft_state: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint and the speculators format store: everything but the frozen verifier tensors."""
    return {name: value for name, value in draft_state.items() if name not in FROZEN}
