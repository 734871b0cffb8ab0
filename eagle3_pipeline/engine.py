"""Starting vLLM on the target, the same way in every stage that needs it (01, 02, 06).

vLLM is imported only inside `start_engine`, so stages that do not run the target (03, 04, 05) work in an
environment without vLLM. vLLM spawns its engine process: callers need an `if __name__ == "__main__":`
guard in the script that starts it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import EngineConfig, TargetConfig

# On a CPU-only machine the KV cache lives in host memory. An explicit size: vLLM's default is sized for
# servers, and an explicit size skips its free-memory check, which other jobs on a shared machine can fail.
CPU_KV_CACHE_BYTES = 2 * 2**30


def on_cpu() -> bool:
    import torch

    return not torch.cuda.is_available()


def start_engine(target: TargetConfig, model_dir: Path, engine: EngineConfig | None = None, **llm_kwargs: Any):
    """A `vllm.LLM` on the target with the config's engine settings; `llm_kwargs` adds or overrides."""
    engine = engine or target.engine
    if on_cpu():
        llm_kwargs.setdefault("kv_cache_memory_bytes", CPU_KV_CACHE_BYTES)
        if engine.cpu_reserved_cores is not None:  # read by the engine process vLLM spawns below
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(engine.cpu_reserved_cores)
        if (llm_kwargs.get("speculative_config") or {}).get("method") == "eagle3" and is_mla(model_dir):
            # vLLM CPU: the target's MLA backend and the Llama draft's attention disagree on the KV block size;
            # the target then runs the same attention in its expanded (non-MLA) form
            os.environ["VLLM_MLA_DISABLE"] = "1"
            print("vLLM CPU: MLA target with a Llama-style draft: VLLM_MLA_DISABLE=1")
    from vllm import LLM

    settings = dict(
        model=str(model_dir),
        tokenizer=str(model_dir),
        trust_remote_code=target.trust_remote_code,
        tensor_parallel_size=engine.tensor_parallel_size,
        max_model_len=engine.max_model_len,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        max_num_seqs=engine.max_num_seqs,
        enforce_eager=engine.enforce_eager,
        dtype=engine.dtype,
        seed=0,
    )
    settings.update(llm_kwargs)
    return LLM(**settings)


def is_mla(model_dir: Path) -> bool:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    return "kv_lora_rank" in config.get("text_config", config)
