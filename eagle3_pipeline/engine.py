"""Starting vLLM on the target, the same way in every stage that needs it (01, 02, 06); the settings are also
what the serving command prints (export/serving.py), so that a printed command runs the engine a stage measured.

vLLM is imported only inside `start_engine`, so stages that do not run the target (03, 04, 05) work in an
environment without vLLM. vLLM spawns its engine process: callers need an `if __name__ == "__main__":`
guard in the script that starts it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import ConfigError
from eagle3_pipeline.config_sections import EngineConfig, TargetConfig
from eagle3_pipeline.target import is_mla, text_config

# On a CPU-only machine the KV cache lives in host memory. An explicit size: vLLM's default is sized for
# servers, and an explicit size skips its free-memory check, which other jobs on a shared machine can fail.
# 512 MiB holds 23k SmolLM2 tokens in bf16, the demo's 32 sequences whole; each GiB more costs an engine start
# about 4 s on 2 cores (its pages are written at start). `target.engine.kv_cache_memory_gb` sets another size.
CPU_KV_CACHE_BYTES = 512 * 2**20


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def start_engine(target: TargetConfig, model_dir: Path, engine: EngineConfig | None = None, text_only: bool = False,
                 **llm_kwargs: Any):
    """A `vllm.LLM` on the target with the config's engine settings; `llm_kwargs` adds or overrides. `text_only`:
    no prompt will carry images (`text_only_settings`).

    The engine's environment variables are set only while it is built: vLLM's engine and worker processes,
    spawned then, take their copy, and the next engine of this process starts from the caller's environment.
    """
    settings, environment = engine_settings(target, model_dir, engine, **llm_kwargs, **text_only_settings(text_only))
    check_model_runner_choice({**os.environ, **environment})
    mla_target = is_mla(text_config(model_dir))
    if serves_mla_draft(settings) and not mla_target:
        raise ConfigError("vLLM serves an MLA draft (draft.attention mla) only on an MLA target: "
                          + ("vLLM CPU's draft CPU_MLA backend keeps KV blocks of 16 and the target's CPU_ATTN "
                             "multiples of 32" if on_cpu() else
                             "vLLM GPU (0.26 to 0.34) picks the draft's MLA prefill backend by the target's MLA "
                             "head dims, which a dense target lacks"))
    if settings["dtype"] == "float32" and mla_target and not on_cpu():
        raise ConfigError("dtype float32 (target.engine.dtype or validate.engine_dtype) on an MLA target: vLLM GPU has "
                          "no float32 MLA attention (0.26's CUDA MLA backends take float16 and bfloat16); use float16")
    if "VLLM_MLA_DISABLE" in environment:
        print("vLLM CPU: MLA target with a Llama-style draft: VLLM_MLA_DISABLE=1")
    if environment.get("VLLM_USE_V2_MODEL_RUNNER") == "0":
        print("vLLM GPU: MLA target with a Llama-style draft: V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
    from vllm import LLM

    with scoped_environment(environment):
        return LLM(**settings)


def text_only_settings(text_only: bool) -> dict[str, Any]:
    """`vllm.LLM` keywords for an engine whose prompts carry no images (`text_only`): a multimodal target's encoders
    are neither loaded nor profiled at start (Kimi-K2.5's MoonViT tower and its encoder cache). vLLM's
    `language_model_only` (0.26 and 0.32 have it, 0.16 does not: there the engine starts as before); a text-only
    target ignores it."""
    if not text_only:
        return {}
    from vllm.engine.arg_utils import EngineArgs

    return {"language_model_only": True} if "language_model_only" in EngineArgs.__dataclass_fields__ else {}


def speculative_config(draft_dir: Path, k: int) -> dict:
    """vLLM's `speculative_config` serving the EAGLE-3 draft folder `draft_dir` (either export format) with k
    speculative tokens: what 06 measures, 05's serving command prints and 01 regenerates with."""
    return {"method": "eagle3", "model": str(Path(draft_dir).resolve()), "num_speculative_tokens": k}


@contextlib.contextmanager
def scoped_environment(variables: dict[str, str]) -> Iterator[None]:
    """`variables` in os.environ inside the block; each one's previous value (or absence) restored after."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def engine_settings(target: TargetConfig, model_dir: Path, engine: EngineConfig | None = None,
                    **llm_kwargs: Any) -> tuple[dict[str, Any], dict[str, str]]:
    """(`vllm.LLM` keywords, environment variables) of an engine on the target: what `start_engine` starts
    and what `export.serving.server_command` prints, so that a printed command runs the engine a stage measured."""
    engine = engine or target.engine
    settings = dict(
        model=str(model_dir),  # and its tokenizer, vLLM's default
        trust_remote_code=target.trust_remote_code,
        tensor_parallel_size=engine.tensor_parallel_size,
        max_model_len=engine.max_model_len,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        max_num_seqs=engine.max_num_seqs,
        enforce_eager=engine.enforce_eager,
        dtype=engine.dtype,
        seed=0,
    )
    if engine.kv_cache_memory_gb is not None:
        settings["kv_cache_memory_bytes"] = int(engine.kv_cache_memory_gb * 2**30)
    settings.update(llm_kwargs)
    environment = {}
    mla_target = is_mla(text_config(model_dir))
    if on_cpu():
        settings.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
        if engine.cpu_reserved_cores is not None:
            environment["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(engine.cpu_reserved_cores)
        if llama_draft_on_mla_target(settings, model_dir):
            # vLLM CPU: the target's MLA backend and the Llama draft's attention disagree on the KV block size;
            # the target then runs the same attention in its expanded (non-MLA) form
            environment["VLLM_MLA_DISABLE"] = "1"
        elif mla_target and settings["dtype"] == "float32":
            # vLLM CPU prefers its AMX MLA backend where the processor has AMX, and that packs bf16/fp16/int8
            # weights only; the reference CPU MLA backend runs fp32
            settings.setdefault("attention_backend", "CPU_MLA")
    elif llama_draft_on_mla_target(settings, model_dir) and mrv2_plans_the_drafts_own_attention() is False:
        # vLLM GPU, Model Runner V2 before 0.33: the draft's FlashAttention-3 scheduler metadata is planned with
        # the target's MLA shape (1 KV head of 576) and run with the draft's (head_dim 128), which FA3 refuses
        # at engine start ("scheduler_metadata must have shape"); V1 drafts without that plan. 0.26 runs MoE
        # targets on V1 unless told otherwise; from 0.29 MRv2 is every architecture's default.
        environment["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    return settings, environment


def llama_draft_on_mla_target(settings: Mapping[str, Any], model_dir: Path) -> bool:
    """Whether the engine serves a Llama-style EAGLE-3 draft on an MLA target: the pairing whose attention needs
    the rules above (an MLA draft shares the MLA target's backend)."""
    eagle3 = (settings.get("speculative_config") or {}).get("method") == "eagle3"
    return eagle3 and is_mla(text_config(model_dir)) and not serves_mla_draft(settings)


def serves_mla_draft(settings: Mapping[str, Any]) -> bool:
    """Whether the engine's EAGLE-3 draft has MLA attention (`draft.attention: mla`; its config.json sets
    kv_lora_rank, as vLLM's own rule reads it)."""
    speculative = settings.get("speculative_config") or {}
    config = Path(speculative.get("model", "")) / "config.json"
    return speculative.get("method") == "eagle3" and config.is_file() and is_mla(json.loads(config.read_text()))


# the first vLLM release read to size a draft's FlashAttention plan from the draft's own layers under MRv2
MRV2_DRAFT_ATTENTION_FIXED = (0, 33)
# the first vLLM release without Model Runner V1 (vllm/platforms/interface.py refuses VLLM_USE_V2_MODEL_RUNNER != 1)
V1_RUNNER_REMOVED = (0, 34)


def installed_vllm() -> tuple[int, ...] | None:
    """The installed vLLM's (major, minor) under either distribution name (`vllm`, or the CPU build's
    `vllm-cpu`), or None where vLLM is not installed here."""
    from patches.patch import installed_version

    version = installed_version("vllm")
    return None if version is None else version.release[:2]


def mrv2_plans_the_drafts_own_attention() -> bool | None:
    """Whether the installed GPU vLLM is known to plan an EAGLE draft's attention for the draft's own shape under
    Model Runner V2; None where vLLM is not installed here (05 in a training environment): the printed command
    is then the one for 0.33 and later, with a note for the releases before (export/serving.py)."""
    version = installed_vllm()
    return None if version is None else version >= MRV2_DRAFT_ATTENTION_FIXED


def check_model_runner_choice(environment: Mapping[str, str]) -> None:
    """Before an engine loads anything: vLLM 0.34 and later have Model Runner V2 only, and refuse
    VLLM_USE_V2_MODEL_RUNNER set to anything but 1; say so as a config error instead of a traceback."""
    value = environment.get("VLLM_USE_V2_MODEL_RUNNER")
    version = installed_vllm()
    if value not in (None, "1") and version is not None and version >= V1_RUNNER_REMOVED:
        raise ConfigError(f"VLLM_USE_V2_MODEL_RUNNER={value}: vLLM {'.'.join(map(str, version))} has no Model Runner "
                          "V1 (removed in 0.34); unset the variable")
