"""The export format: what a draft folder holds, the spec a config implies, and reading a folder's spec.

05 writes draft folders in this format and 06 checks them against it; both import this module, and it imports
neither of them, nor training code nor speculators (06 runs in vLLM 0.16's environment, which has none).

A spec has the form of eagle3_pipeline/reference/aq_medai_kimi_k25_eagle3.json (the AQ-MedAI reference):

    {"config": {...config.json...}, "tensors": {name: {"shape": [...], "dtype": "bfloat16"}}}

- `reference_spec(config)`: the reference-format spec a run config implies (`05_export.py --spec-only`). The
  config.json comes from the `draft:` section and a few target facts; the tensor shapes follow from the
  config.json (`draft_tensor_shapes`; tests hold them equal to the draft training builds).
- `implied_tensors(config_json, fmt)`: the tensors a config.json implies (the export's own consistency).
- `read_spec(path)`: the spec of an export folder (config.json + safetensors headers) or of a spec.json.
The speculators format's config.json is speculators' own serialisation: 05 builds it and records its spec
in 05's manifest (`specs`), where 06 reads it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.config_sections import MLA_SIZES, DraftConfig
from eagle3_pipeline.draft_spec import floating_shapes, stored_tensors, vocab_map_shapes
from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.target import run_aux_layer_ids, target_facts

WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "spec.json"
EXPORT_DTYPE = torch.bfloat16  # floating tensors; d2t stays int64 and t2d bool
REFERENCE_ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"  # draft.attention mla
# not deepseek_v3: vLLM reads a deepseek_v3 draft as a DeepSeek MTP module (SpeculativeConfig.hf_config_override)
MLA_MODEL_TYPE = "deepseek_v2"
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass(frozen=True)
class Spec:
    config: dict[str, Any]
    tensors: dict[str, dict[str, Any]]  # name -> {"shape": [...], "dtype": "bfloat16"}

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "tensors": self.tensors}


def spec_format(config_json: dict) -> str:
    """"speculators" when a config.json carries speculators' section, else "reference"."""
    return "speculators" if "speculators_config" in config_json else "reference"


# ------------------------------------------------------------------------------------------- config.json
def attention_config(draft: DraftConfig) -> dict:
    """The attention's keys of config.json: the reference's (Llama) or, for `draft.attention: mla`, the ones
    vLLM's Eagle3DeepseekV2ForCausalLM reads (a DeepseekV3Config; head_dim and num_key_value_heads as that
    config derives them, so transformers and vLLM read the same values)."""
    llama = draft.attention == "llama"
    shared = {"architectures": [REFERENCE_ARCHITECTURE if llama else MLA_ARCHITECTURE],
              "model_type": "llama" if llama else MLA_MODEL_TYPE, "num_hidden_layers": 1,
              "hidden_size": draft.hidden_size, "intermediate_size": draft.intermediate_size,
              "num_attention_heads": draft.num_attention_heads}
    if llama:
        return {**shared, "num_key_value_heads": draft.num_key_value_heads, "head_dim": draft.head_dim}
    return {**shared, "num_key_value_heads": draft.num_attention_heads, "head_dim": draft.qk_rope_head_dim,
            **{size: getattr(draft, size) for size in MLA_SIZES}, "first_k_dense_replace": 1, "rope_interleave": True}


def served_rope_scaling(draft: DraftConfig, max_positions: int) -> dict | None:
    """`draft.rope_scaling` as config.json states it. An MLA draft without scaling states DeepSeek's yarn at factor
    1, which is plain rotary embedding: vLLM 0.26's MLA draft layer reads every draft's rope as yarn and needs its
    factor (0.32 and 0.34 read plain rope as such; tests/export/test_vllm_draft_forward.py serves this form)."""
    if draft.attention == "llama" or draft.rope_scaling is not None:
        return draft.rope_scaling
    return {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": max_positions, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def reference_config(draft: DraftConfig, facts: dict[str, Any], aux_ids: list[int], serving_len: int) -> dict:
    """config.json in the reference's fields and order, plus `norm_before_residual` written explicitly (and
    `norm_before_fc` / `fc_norm` / `norm_output` when on: vLLM reads them as top-level keys)."""
    return {
        **attention_config(draft),
        "hidden_act": "silu",
        "vocab_size": facts["vocab_size"],
        "draft_vocab_size": draft.draft_vocab_size,
        # rope has no scaling here, so a larger value changes nothing but what vLLM accepts to serve
        "max_position_embeddings": max(draft.max_position_embeddings, serving_len),
        "rope_theta": draft.rope_theta,
        "rope_scaling": served_rope_scaling(draft, max(draft.max_position_embeddings, serving_len)),
        "rms_norm_eps": draft.rms_norm_eps,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": facts["bos_token_id"],
        "eos_token_id": facts["eos_token_id"],
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids), "use_aux_hidden_state": True},
        # vLLM reads an absent field as false for this format, but as true for the speculators format:
        # written out, nobody has to know which default applies
        "norm_before_residual": draft.norm_before_residual,
        # off in the reference, which leaves them out; written only when on
        **{flag: True for flag in ("norm_before_fc", "fc_norm", "norm_output") if getattr(draft, flag)},
    }


def run_reference_config(config: RunConfig) -> dict:
    """The reference config.json a run config implies (aux ids as the run captures them)."""
    facts = target_facts(config)
    aux_ids = run_aux_layer_ids(config, facts["num_hidden_layers"])
    return reference_config(config.draft, facts, aux_ids, config.target.engine.max_model_len)


def draft_fields(config_json: dict) -> tuple[DraftConfig, list[int], int]:
    """The draft shape, aux ids and target vocab a config.json (either format) describes."""
    layer = config_json.get("transformer_layer_config", config_json)
    rope = layer.get("rope_parameters") or {}
    aux = config_json.get("eagle_aux_hidden_state_layer_ids") or \
        (config_json.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    mla = {key: layer.get(key) for key in MLA_SIZES} if "kv_lora_rank" in layer else {}
    draft = DraftConfig(
        **({"attention": "mla", **mla} if mla else {}),
        hidden_size=layer["hidden_size"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
        intermediate_size=layer["intermediate_size"], draft_vocab_size=config_json["draft_vocab_size"],
        rope_theta=layer.get("rope_theta", rope.get("rope_theta", 1e6)),
        max_position_embeddings=layer["max_position_embeddings"], rms_norm_eps=layer["rms_norm_eps"],
        norm_before_residual=bool(config_json.get("norm_before_residual", False)),
        norm_before_fc=bool(config_json.get("norm_before_fc", False)),
        norm_output=bool(config_json.get("norm_output", False)),
        fc_norm=bool(config_json.get("fc_norm", False)),
    )
    return draft, list(aux or [0, 1, 2]), layer["vocab_size"]  # no ids: vLLM's default of 3 aux states


# ---------------------------------------------------------------------------------------------- tensors
def draft_tensor_shapes(config_json: dict) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype as exported)} of every tensor of the draft a config.json describes, under the
    training draft's names (draft_spec.py), frozen verifier tensors included."""
    draft, aux, vocab = draft_fields(config_json)
    floating = floating_shapes(draft, len(aux), vocab)
    return {**{name: (shape, dtype_name(EXPORT_DTYPE)) for name, shape in floating.items()},
            **vocab_map_shapes(draft, vocab)}


def fold_aux_scale(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's state with 04's `aux_scale` (train.standardize_aux) folded into fc.weight: fc(aux * scale)
    is fc with its input columns scaled, so the exported draft has the reference's tensors and semantics."""
    if "aux_scale" not in state:
        return state
    folded = {name: value for name, value in state.items() if name != "aux_scale"}
    folded["fc.weight"] = state["fc.weight"] * state["aux_scale"].to(state["fc.weight"].dtype)
    return folded


def export_state_dict(draft_state: Mapping[str, Any], fmt: str) -> dict[str, Any]:
    """The tensors (or entries) a format stores, by name: speculators = the checkpoint's layers.0.* names;
    reference = the reference's (eagle3_pipeline/reference/aq_medai_kimi_k25_eagle3.json):

        layers.0.<rest>                                   -> midlayer.<rest>
        fc.weight, norm.weight, lm_head.weight, d2t, t2d  -> unchanged
        embed_tokens, verifier_norm, verifier_lm_head     -> dropped (vLLM shares the target's embedding)
    """
    stored = stored_tensors(draft_state)
    if fmt == "speculators":
        return stored
    if any(name.startswith("layers.1.") for name in stored):
        raise ValueError("the reference format holds one decoder layer; this draft has more")
    return {name.replace("layers.0.", "midlayer.", 1): value for name, value in stored.items()}


def implied_tensors(config_json: dict, fmt: str) -> dict[str, dict[str, Any]]:
    """{name: {"shape", "dtype"}} of the tensors a format stores for the draft a config.json describes."""
    entries = {name: {"shape": shape, "dtype": dtype} for name, (shape, dtype) in draft_tensor_shapes(config_json).items()}
    return export_state_dict(entries, fmt)


def reference_spec(config: RunConfig) -> Spec:
    """The reference-format spec a run config implies."""
    reference = run_reference_config(config)
    return Spec(reference, implied_tensors(reference, "reference"))


def export_dtype(tensor: torch.Tensor) -> torch.dtype:
    return EXPORT_DTYPE if tensor.is_floating_point() else tensor.dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------ reading
def read_spec(path: Path) -> Spec:
    """An export folder (config.json + *.safetensors headers), a folder holding only spec.json, or a spec json."""
    path = Path(path)
    if path.is_file():
        data = json.loads(path.read_text())
        if "config" not in data or "tensors" not in data:
            raise StageError(f"{path}: not a spec (expected the keys `config` and `tensors`)")
        return Spec(data["config"], {k: {"shape": v["shape"], "dtype": v["dtype"]} for k, v in data["tensors"].items()})
    if not (path / "config.json").is_file():
        if (path / SPEC_FILE).is_file():
            return read_spec(path / SPEC_FILE)
        raise StageError(f"{path}: neither an export folder (config.json) nor a spec json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise StageError(f"{path}: config.json but no *.safetensors weights")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                piece = f.get_slice(name)
                dtype = piece.get_dtype()
                tensors[name] = {"shape": list(piece.get_shape()), "dtype": SAFETENSORS_DTYPES.get(dtype, dtype)}
    return Spec(json.loads((path / "config.json").read_text()), tensors)


def read_tensor(folder: Path, name: str) -> torch.Tensor | None:
    """One tensor's values from an export folder, or None when no file holds it."""
    for file in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 - a safetensors handle is not a dict
                return f.get_tensor(name)
    return None
