"""vLLM 0.16/0.17: Kimi-K2.5 (and DeepSeek-V2/V3) as EAGLE-3 targets and hidden-state capture sources."""

from __future__ import annotations

from patches.patch import Patch

CLASSES = "patches.vllm_classes.eagle3_deepseek_kimi"
# architecture -> the subclass registered for it. "DeepseekV2ForCausalLM" is also what Kimi-K2.5 builds
# its language model as, through the registry.
REPLACEMENTS = {
    "DeepseekV2ForCausalLM": "Eagle3DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "Eagle3DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration": "Eagle3KimiK25ForConditionalGeneration",
}


def apply() -> str:
    from vllm import ModelRegistry

    missing = [arch for arch in REPLACEMENTS if arch not in ModelRegistry.get_supported_archs()]
    if missing:
        raise RuntimeError(f"vLLM has no {', '.join(missing)} to replace")
    for arch, subclass in REPLACEMENTS.items():
        ModelRegistry.register_model(arch, f"{CLASSES}:{subclass}")
    return "registered " + ", ".join(f"{arch} -> {subclass}" for arch, subclass in REPLACEMENTS.items())


PATCH = Patch(
    name="vllm-eagle3-deepseek-kimi",
    package="vllm",
    affected="<0.18",
    versions=">=0.16,<0.18",
    why=(
        "vLLM 0.16/0.17's DeepseekV2ForCausalLM/DeepseekV3ForCausalLM and KimiK25ForConditionalGeneration do "
        "not implement SupportsEagle3, so they can neither serve an EAGLE-3 draft (stage 06) nor hand out aux "
        "hidden states (stage 02's capture worker). The EAGLE proposer also reads config.image_token_index "
        "from multimodal targets, which Kimi-K2.5's config lacks (its id is media_placeholder_token_id)."
    ),
    how=(
        "ModelRegistry.register_model swaps in subclasses (patches.vllm_classes.eagle3_deepseek_kimi): "
        "set_aux_hidden_state_layers / get_eagle3_aux_hidden_state_layers (default (2, L//2, L-3)); a "
        "DeepseekV2Model whose forward also returns hidden_states + residual entering the chosen layers, "
        "and is upstream's forward untouched when none are set; the Kimi wrapper delegates to its language "
        "model and sets config.image_token_index = media_placeholder_token_id."
    ),
    upstream=(
        "vLLM 0.18.0 (deepseek_v2.py: SupportsEagle3 + aux capture in DeepseekV2Model.forward; kimi_k25.py: "
        "delegation; v1/spec_decode/eagle.py: Kimi's media_placeholder_token_id)"
    ),
    remove_when="the GPU nodes run vLLM >= 0.18",
    apply=apply,
)
