"""`draft.attention: mla`: the draft's decoder layer with DeepSeek-V3's multi-head latent attention (MLA).

The layer is transformers' `DeepseekV3DecoderLayer` (MLA attention, a dense MLP: the draft's layer 0 sits below
`first_k_dense_replace`) made into an EAGLE-3 first layer the way speculators makes its Llama and Qwen3 ones
(`Eagle3FirstLayerMixin`: the layer reads [input_layernorm(embed) | hidden_norm(hidden)], 2H wide). In MLA the
projections that read the layer's input are the query's low-rank q_a_proj and the key/value latent's
kv_a_proj_with_mqa; those become 2H wide, as in vLLM's Eagle3DeepseekV2ForCausalLM.

speculators picks a draft's layer classes by the layer config's model_type from its `model_classes` registry;
`register()` adds "deepseek_v3" there (its registry, not a copy of its model).

To match what vLLM serves: the q_a / kv_a latent norms take the draft's rms_norm_eps (transformers builds them
with 1e-6), and rotary embedding turns interleaved pairs (`rope_interleave`, stated although transformers'
default: vLLM's MLA rope is not neox-style).
"""

from __future__ import annotations

import torch
from speculators.models import base_components
from speculators.models.eagle3 import model_definitions
from speculators.models.eagle3.model_definitions import Eagle3FirstLayerMixin
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

MODEL_TYPE = "deepseek_v3"


class DeepseekV3DecoderEagle3FirstLayer(Eagle3FirstLayerMixin, DeepseekV3DecoderLayer):
    def __init__(self, config: DeepseekV3Config, layer_idx: int, norm_before_residual: bool = False):
        super().__init__(config, layer_idx)
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        attention, wide = self.self_attn, 2 * config.hidden_size
        attention.q_a_proj = torch.nn.Linear(wide, config.q_lora_rank, bias=False)
        attention.q_a_layernorm = DeepseekV3RMSNorm(config.q_lora_rank, eps=config.rms_norm_eps)
        attention.kv_a_proj_with_mqa = torch.nn.Linear(wide, config.kv_lora_rank + config.qk_rope_head_dim, bias=False)
        attention.kv_a_layernorm = DeepseekV3RMSNorm(config.kv_lora_rank, eps=config.rms_norm_eps)


def register() -> None:
    """Make speculators build "deepseek_v3" layer configs with the MLA first layer (idempotent)."""
    model_definitions.model_classes[MODEL_TYPE] = base_components.ModelComponents(
        first_layer_class=DeepseekV3DecoderEagle3FirstLayer, decoder_layer_class=DeepseekV3DecoderLayer,
        norm_class=DeepseekV3RMSNorm, rotary_emb_class=DeepseekV3RotaryEmbedding)


def mla_layer_config(draft, shared: dict) -> DeepseekV3Config:
    """The one-layer DeepseekV3Config of an MLA draft (`draft` is a config_sections.DraftConfig; `shared` the keys
    every draft layer config takes, draft_model.build_draft's)."""
    return DeepseekV3Config(
        **shared,
        first_k_dense_replace=1,  # layer 0 has the dense MLP
        num_key_value_heads=draft.num_attention_heads,
        q_lora_rank=draft.q_lora_rank,
        kv_lora_rank=draft.kv_lora_rank,
        qk_nope_head_dim=draft.qk_nope_head_dim,
        qk_rope_head_dim=draft.qk_rope_head_dim,
        v_head_dim=draft.v_head_dim,
        rope_interleave=True,
    )
