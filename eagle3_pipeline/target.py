"""The target model: where its folder is and what its config.json says, read in this one place.

Every stage that needs a fact about the target (its folder, text config, vocab size, layers, whether its
attention is MLA) asks here, so two readers cannot drift apart. Multimodal targets (Kimi-K2.5) nest their
text model's config under `text_config`; everything here returns the text model's values.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import ConfigError, RunConfig
from eagle3_pipeline.config_sections import TargetConfig
from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.stand_ins import ensure_stand_in

FACT_KEYS = ("vocab_size", "num_hidden_layers", "bos_token_id", "eos_token_id")  # what an export copies


def target_path(target: TargetConfig) -> Path:
    """The target's local Hugging Face folder, building the stand-in when the config names one.

    A folder whose tokenizer is its own code needs `trust_remote_code`: without it transformers (and vLLM)
    fall back to a generic backend built from the vocabulary files, which may split special tokens or
    pre-tokenize otherwise, so that is refused here rather than loaded."""
    path = ensure_stand_in(target.stand_in) if target.stand_in is not None else Path(target.path)
    if not (path / "config.json").is_file():
        raise StageError(f"target.path {path}: not a Hugging Face model folder (no config.json)")
    remote_class = remote_tokenizer_class(path)
    if remote_class and not target.trust_remote_code:
        raise ConfigError(f"target {path}: its tokenizer is remote code ({remote_class} in tokenizer_config.json's "
                          "auto_map), loaded only with target.trust_remote_code: true")
    return path


def remote_tokenizer_class(model_dir: Path) -> str | None:
    """`module.Class` of the tokenizer the folder ships as code (tokenizer_config.json's auto_map), or None."""
    config_file = Path(model_dir) / "tokenizer_config.json"
    auto_map = json.loads(config_file.read_text()).get("auto_map", {}) if config_file.is_file() else {}
    remote_class = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    return remote_class[0] if isinstance(remote_class, list) else remote_class


def text_config(model_dir: Path) -> dict:
    """The target's text-model config: config.json itself, or its `text_config` (Kimi-K2.5's DeepSeek-V3)."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return config.get("text_config", config)


# config.json keys naming the token a chat template writes per image (Kimi-K2.5's, then other VLMs')
IMAGE_TOKEN_KEYS = ("media_placeholder_token_id", "image_token_id", "image_token_index")


def image_token_id(model_dir: Path) -> int | None:
    """The id of the placeholder token vLLM expands into an image's embeddings; None for a text-only target."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if "vision_config" not in config:
        return None
    return next((config[key] for key in IMAGE_TOKEN_KEYS if isinstance(config.get(key), int)), None)


def is_mla(text: dict) -> bool:
    """Multi-head latent attention (DeepSeek-V3, Kimi): vLLM's own rule, a `kv_lora_rank` that is set."""
    return text.get("kv_lora_rank") is not None


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default: one early, one middle, one late layer (vLLM's and speculators' choice)."""
    return [2, num_layers // 2, num_layers - 3]


def serving_path(target: TargetConfig) -> str:
    """The target as a serving command (and a speculators config's verifier) names it: its folder."""
    return str(target_path(target)) if target.stand_in is not None else str(target.path)


def architectures(target: TargetConfig) -> list[str]:
    """The target's `architectures` (config.json), or none where its folder is not at hand."""
    config_file = Path(serving_path(target)) / "config.json"
    return json.loads(config_file.read_text()).get("architectures", []) if config_file.is_file() else []


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
    text = text_config(folder)
    read = {key: text.get(key) for key in FACT_KEYS}
    if given is not None and given.model_dump() != read:
        raise ConfigError(f"export.target_facts {given.model_dump()} disagree with {folder}/config.json {read}")
    return read


def run_aux_layer_ids(config: RunConfig, num_layers: int) -> list[int]:
    """The aux layer ids the run captures, vLLM's convention (02_hidden_states records the same list)."""
    return list(config.capture.aux_layer_ids or default_aux_layer_ids(num_layers))
