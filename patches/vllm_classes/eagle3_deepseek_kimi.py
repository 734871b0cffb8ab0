"""vLLM 0.18's EAGLE-3 target interface on vLLM 0.16/0.17's DeepSeek-V2/V3 and Kimi-K2.5 classes.

Registered by `patches.vllm_eagle3_deepseek_kimi` in place of the upstream classes. Without aux layers
set (no EAGLE-3 draft, no capture) every forward is the upstream one, unchanged.
"""

from __future__ import annotations

from itertools import islice

import torch
from vllm.distributed import get_pp_group
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2ForCausalLM,
    DeepseekV2Model,
    DeepseekV3ForCausalLM,
    _get_llama_4_scaling,
)
from vllm.model_executor.models.interfaces import SupportsEagle, SupportsEagle3
from vllm.model_executor.models.kimi_k25 import KimiK25ForConditionalGeneration
from vllm.sequence import IntermediateTensors


class Eagle3DeepseekV2Model(DeepseekV2Model):
    """Returns `(hidden_states, aux_hidden_states)` once aux layers are set, as vLLM 0.18 does.

    Aux layer id i is the residual stream entering layer i (`hidden_states + residual`): HF
    `output_hidden_states[i]`. The forward below is vLLM 0.16.0's `DeepseekV2Model.forward` plus the aux
    capture; `tests/patches/test_vllm016_source.py` pins the upstream body it re-expresses.
    """

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors | tuple[torch.Tensor, list[torch.Tensor]]:
        if not self.aux_hidden_state_layers:
            # Named, not super(): vLLM's compile wrapper swaps this function's code object, and super()
            # would give it a closure cell the compiled code may not carry.
            return DeepseekV2Model.forward(self, input_ids, positions, intermediate_tensors, inputs_embeds)

        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]

        llama_4_scaling_config = getattr(self.config, "llama_4_scaling", None)
        llama_4_scaling = None
        if llama_4_scaling_config is not None:
            llama_4_scaling = _get_llama_4_scaling(
                original_max_position_embeddings=llama_4_scaling_config["original_max_position_embeddings"],
                scaling_beta=llama_4_scaling_config["beta"],
                positions=positions,
            )

        aux_hidden_states = []
        for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), start=self.start_layer):
            if idx in self.aux_hidden_state_layers:
                # Before layer 0 the residual is not split off yet: the stream is the embedding itself.
                aux_hidden_states.append(hidden_states if residual is None else hidden_states + residual)
            hidden_states, residual = layer(positions, hidden_states, residual, llama_4_scaling)

        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})

        hidden_states, _ = self.norm(hidden_states, residual)
        if aux_hidden_states:
            return hidden_states, aux_hidden_states
        return hidden_states


class Eagle3DeepseekV2ForCausalLM(DeepseekV2ForCausalLM, SupportsEagle3):
    """`SupportsEagle3` for DeepSeek causal LMs; their forward passes the model's tuple through as is."""

    model_cls = Eagle3DeepseekV2Model

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.model.aux_hidden_state_layers = layers

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        num_layers = len(self.model.layers)
        return (2, num_layers // 2, num_layers - 3)


class Eagle3DeepseekV3ForCausalLM(Eagle3DeepseekV2ForCausalLM, DeepseekV3ForCausalLM):
    pass


class Eagle3KimiK25ForConditionalGeneration(KimiK25ForConditionalGeneration, SupportsEagle, SupportsEagle3):
    """Kimi-K2.5 as an EAGLE-3 target: aux layers are its DeepSeek-V3 language model's.

    Its language model is built through the model registry as "DeepseekV2ForCausalLM", which this
    patch registers as `Eagle3DeepseekV2ForCausalLM`.
    """

    def __init__(self, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # vLLM 0.16's EAGLE proposer reads `config.image_token_index` from any multimodal target it does
        # not know by name; Kimi-K2.5's config names its media placeholder differently (vLLM 0.18 special-
        # cases Kimi in the proposer to read `media_placeholder_token_id`; the same id is given here).
        if not hasattr(self.config, "image_token_index"):
            self.config.image_token_index = self.config.media_placeholder_token_id

    def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
        self.language_model.set_aux_hidden_state_layers(layers)

    def get_eagle3_aux_hidden_state_layers(self) -> tuple[int, ...]:
        return self.language_model.get_eagle3_aux_hidden_state_layers()
