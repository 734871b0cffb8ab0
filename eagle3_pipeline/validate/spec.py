"""Specs: what an export's config.json and tensors are, or must be.

A spec has the form of eagle3_pipeline/reference/aq_medai_kimi_k25_eagle3.json (the AQ-MedAI reference):

    {"config": {...config.json...}, "tensors": {name: {"shape": [...], "dtype": "bfloat16"}}}

- `run_spec(config, fmt)`: the spec a run config implies. The config.json comes from the `draft:` section
  and a few target facts; the tensor shapes come from building the draft on the meta device (no memory, no
  weights, no earlier stage), so they are exactly what training builds. This is `05_export.py --spec-only`.
- `implied_tensors(config_json, fmt)`: the tensors a config.json implies (the export's own consistency).
- `read_spec(path)`: the spec of an export folder (config.json + safetensors headers) or of a spec.json.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from eagle3_pipeline.capture import default_aux_layer_ids, target_text_config
from eagle3_pipeline.config import ConfigError, DraftConfig, RunConfig
from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.stand_ins import target_path
from eagle3_pipeline.train.draft_model import FROZEN, build_draft, reference_state_dict

FORMATS = ("reference", "speculators")
WEIGHTS_FILE = "model.safetensors"
SPEC_FILE = "spec.json"
EXPORT_DTYPE = torch.bfloat16  # floating tensors; d2t stays int64 and t2d bool
REFERENCE_ARCHITECTURE = "LlamaForCausalLMEagle3"
FACT_KEYS = ("vocab_size", "num_hidden_layers", "bos_token_id", "eos_token_id")
SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
                      "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                      "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


@dataclass(frozen=True)
class Spec:
    config: dict[str, Any]
    tensors: dict[str, dict[str, Any]]  # name -> {"shape": [...], "dtype": "bfloat16"}

    def to_json(self) -> dict[str, Any]:
        return {"config": self.config, "tensors": self.tensors}


# ------------------------------------------------------------------------------------------- target facts
def target_facts(config: RunConfig) -> dict[str, Any]:
    """vocab_size, num_hidden_layers, bos/eos ids: from the target's config.json and/or `export.target_facts`."""
    given = config.export.target_facts
    folder = None
    if config.target.stand_in is not None or (Path(config.target.path) / "config.json").is_file():
        folder = target_path(config.target)
    if folder is None and given is None:
        raise ConfigError(f"target.path {config.target.path} holds no config.json: set export.target_facts "
                          f"({', '.join(FACT_KEYS)}) to export without the target")
    if folder is None:
        return given.model_dump()
    text = target_text_config(folder)
    read = {key: text.get(key) for key in FACT_KEYS}
    if given is not None and given.model_dump() != read:
        raise ConfigError(f"export.target_facts {given.model_dump()} disagree with {folder}/config.json {read}")
    return read


def aux_layer_ids(config: RunConfig, facts: dict[str, Any]) -> list[int]:
    """The aux layer ids the run captures, vLLM's convention (02_hidden_states records the same list)."""
    return list(config.capture.aux_layer_ids or default_aux_layer_ids(facts["num_hidden_layers"]))


# ------------------------------------------------------------------------------------------- config.json
def reference_config(draft: DraftConfig, facts: dict[str, Any], aux_ids: list[int], serving_len: int) -> dict:
    """config.json in the reference's fields and order, plus `norm_before_residual` written explicitly (and
    `norm_before_fc` / `norm_output` when on)."""
    return {
        "architectures": [REFERENCE_ARCHITECTURE],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": draft.hidden_size,
        "intermediate_size": draft.intermediate_size,
        "num_attention_heads": draft.num_attention_heads,
        "num_key_value_heads": draft.num_key_value_heads,
        "head_dim": draft.head_dim,
        "hidden_act": "silu",
        "vocab_size": facts["vocab_size"],
        "draft_vocab_size": draft.draft_vocab_size,
        # rope has no scaling here, so a larger value changes nothing but what vLLM accepts to serve
        "max_position_embeddings": max(draft.max_position_embeddings, serving_len),
        "rope_theta": draft.rope_theta,
        "rope_scaling": draft.rope_scaling,
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
        **{flag: True for flag in ("norm_before_fc", "norm_output") if getattr(draft, flag)},
    }


def speculators_config(reference: dict, verifier: str, verifier_architectures: list[str], k: int) -> dict:
    """The speculators 0.9 config (`vllm serve <dir>` reads verifier and proposal from it) for the same draft."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    model = meta_draft(reference)
    model.config.speculators_config = SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=verifier, architectures=verifier_architectures),
    )
    config = model.config.to_dict()
    layer = config["transformer_layer_config"]
    layer.update(bos_token_id=reference["bos_token_id"], eos_token_id=reference["eos_token_id"])
    layer.pop("transformers_version", None)
    for noise in ("_name_or_path", "transformers_version", "id2label", "label2id"):
        config.pop(noise, None)
    config["torch_dtype"] = "bfloat16"
    return config


# ---------------------------------------------------------------------------------------------- tensors
def draft_fields(config_json: dict) -> tuple[DraftConfig, list[int], int]:
    """The draft shape, aux ids and target vocab a config.json (either format) describes."""
    layer = config_json.get("transformer_layer_config", config_json)
    rope = layer.get("rope_parameters") or {}
    aux = config_json.get("eagle_aux_hidden_state_layer_ids") or \
        (config_json.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    draft = DraftConfig(
        hidden_size=layer["hidden_size"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"], head_dim=layer["head_dim"],
        intermediate_size=layer["intermediate_size"], draft_vocab_size=config_json["draft_vocab_size"],
        rope_theta=layer.get("rope_theta", rope.get("rope_theta", 1e6)),
        max_position_embeddings=layer["max_position_embeddings"], rms_norm_eps=layer["rms_norm_eps"],
        norm_before_residual=bool(config_json.get("norm_before_residual", False)),
        norm_before_fc=bool(config_json.get("norm_before_fc", False)),
        norm_output=bool(config_json.get("norm_output", False)),
    )
    return draft, list(aux or [0, 1, 2]), layer["vocab_size"]  # no ids: vLLM's default of 3 aux states


def meta_draft(config_json: dict):
    """The training draft for a config.json, built on the meta device: shapes without memory or weights."""
    draft, aux, vocab = draft_fields(config_json)
    with torch.device("meta"):
        return build_draft(draft, aux, vocab, attention="sdpa")


def tensor_entries(state: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """{name: {"shape", "dtype"}} in the export's dtypes (floating tensors bf16, d2t int64, t2d bool)."""
    return {name: {"shape": list(t.shape), "dtype": dtype_name(export_dtype(t))} for name, t in state.items()}


def export_dtype(tensor: torch.Tensor) -> torch.dtype:
    return EXPORT_DTYPE if tensor.is_floating_point() else tensor.dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_state_dict(draft_state: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """The tensors a format stores: reference = midlayer.* names; speculators = the checkpoint's layers.0.*.
    Neither holds the frozen verifier tensors: vLLM shares the target's embedding."""
    if fmt == "reference":
        return reference_state_dict(draft_state)
    return {name: tensor for name, tensor in draft_state.items() if name not in FROZEN}


def implied_tensors(config_json: dict, fmt: str) -> dict[str, dict[str, Any]]:
    return tensor_entries(export_state_dict(meta_draft(config_json).state_dict(), fmt))


def run_spec(config: RunConfig, fmt: str) -> Spec:
    """The spec the run config implies for one export format."""
    facts = target_facts(config)
    reference = reference_config(config.draft, facts, aux_layer_ids(config, facts), config.target.engine.max_model_len)
    if fmt == "reference":
        return Spec(reference, implied_tensors(reference, fmt))
    speculators = speculators_config(reference, verifier_path(config), verifier_architectures(config),
                                     config.export.num_speculative_tokens)
    return Spec(speculators, implied_tensors(reference, fmt))


def verifier_path(config: RunConfig) -> str:
    """The target as a serving command names it: its folder (a stand-in's cache folder)."""
    return str(target_path(config.target)) if config.target.stand_in else str(config.target.path)


def verifier_architectures(config: RunConfig) -> list[str]:
    config_file = Path(verifier_path(config)) / "config.json"
    return json.loads(config_file.read_text()).get("architectures", []) if config_file.is_file() else []


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
