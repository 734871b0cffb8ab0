"""The draft described once (04, 05, 06): every tensor's name and shape under the training draft's names, which
of them are the target's frozen copies, and the matrices a token multiplies through, for either attention
(`draft.attention`). The model 04 builds is held to these shapes (tests/train/test_draft_model.py), 05's export
config and spec follow from them (export/format.py), and so does the FLOP count of a training step
(train/flops.py)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from eagle3_pipeline.config_sections import DraftConfig

LAYER = "layers.0."
# The verifier's tensors the draft holds frozen during training; no export stores them (vLLM shares the target's).
FROZEN = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")
def attention_shapes(draft: DraftConfig) -> dict[str, list[int]]:
    """{name under layers.0.: shape} of the attention's tensors. The layer reads [embedding | hidden state], twice
    the hidden size, through its first projections (q, k, v; in MLA the query's and the key/value latent's)."""
    hidden, heads = draft.hidden_size, draft.num_attention_heads
    if draft.attention == "llama":
        return {"self_attn.q_proj.weight": [heads * draft.head_dim, 2 * hidden],
                "self_attn.k_proj.weight": [draft.num_key_value_heads * draft.head_dim, 2 * hidden],
                "self_attn.v_proj.weight": [draft.num_key_value_heads * draft.head_dim, 2 * hidden],
                "self_attn.o_proj.weight": [hidden, heads * draft.head_dim]}
    return {"self_attn.q_a_proj.weight": [draft.q_lora_rank, 2 * hidden],
            "self_attn.q_a_layernorm.weight": [draft.q_lora_rank],
            "self_attn.q_b_proj.weight": [heads * draft.qk_head_dim, draft.q_lora_rank],
            "self_attn.kv_a_proj_with_mqa.weight": [draft.kv_lora_rank + draft.qk_rope_head_dim, 2 * hidden],
            "self_attn.kv_a_layernorm.weight": [draft.kv_lora_rank],
            "self_attn.kv_b_proj.weight": [heads * (draft.qk_nope_head_dim + draft.v_head_dim), draft.kv_lora_rank],
            "self_attn.o_proj.weight": [hidden, heads * draft.v_head_dim]}


def attention_summary(draft: DraftConfig) -> str:
    """The attention's shape in a few words, for messages and model cards."""
    if draft.attention == "llama":
        return f"{draft.num_attention_heads} heads x {draft.head_dim} ({draft.num_key_value_heads} key/value heads)"
    return (f"MLA, {draft.num_attention_heads} heads x {draft.qk_nope_head_dim}+{draft.qk_rope_head_dim} "
            f"(values {draft.v_head_dim}), latents q {draft.q_lora_rank} / kv {draft.kv_lora_rank}")


def floating_shapes(draft: DraftConfig, num_aux: int, target_vocab: int) -> dict[str, list[int]]:
    """{name: shape} of the draft's floating tensors, frozen verifier tensors included."""
    hidden = draft.hidden_size
    return {
        "embed_tokens.weight": [target_vocab, hidden],
        "fc.weight": [hidden, num_aux * hidden],
        **{LAYER + name: shape for name, shape in attention_shapes(draft).items()},
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


def whole_vocabulary(draft: DraftConfig, target_vocab: int) -> bool:
    """Whether the draft predicts the target's whole vocabulary (`draft.draft_vocab_size` = the target's): its ids
    are the target's, so it has no vocabulary maps."""
    return draft.draft_vocab_size == target_vocab


def vocab_map_shapes(draft: DraftConfig, target_vocab: int) -> dict[str, tuple[list[int], str]]:
    """The vocabulary maps 03 builds: d2t (draft id -> target id offset) and t2d (target id -> in the draft). A draft
    over the target's whole vocabulary has none: speculators' draft then holds no maps and vLLM builds none (a `d2t`
    in its weights fails the load)."""
    if whole_vocabulary(draft, target_vocab):
        return {}
    return {"d2t": ([draft.draft_vocab_size], "int64"), "t2d": ([target_vocab], "bool")}


def layer_multiply_adds(draft: DraftConfig) -> int:
    """Multiply-adds per token through the decoder layer's matrices (its 2-D tensors; the rest are norms)."""
    return sum(math.prod(shape) for name, shape in floating_shapes(draft, 1, 1).items()
               if name.startswith(LAYER) and len(shape) == 2)


def attention_multiply_adds_per_key(draft: DraftConfig) -> int:
    """Multiply-adds of one query reading one key: QK^T over the query/key dims, PV over the value dims."""
    if draft.attention == "llama":
        return 2 * draft.num_attention_heads * draft.head_dim
    return draft.num_attention_heads * (draft.qk_head_dim + draft.v_head_dim)


def latent_expansion_multiply_adds(draft: DraftConfig) -> int:
    """attention mla: multiply-adds of expanding one cached key/value latent into every head's key and value
    (kv_b_proj), which the training forward redoes for every earlier entry at each TTT step."""
    if draft.attention == "llama":
        return 0
    return draft.kv_lora_rank * draft.num_attention_heads * (draft.qk_nope_head_dim + draft.v_head_dim)


def stored_tensors(draft_state: Mapping[str, Any]) -> dict[str, Any]:
    """What a checkpoint and the speculators format store: everything but the frozen verifier tensors."""
    return {name: value for name, value in draft_state.items() if name not in FROZEN}
