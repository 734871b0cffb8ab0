"""Greedy generation with vLLM in its own process: `python -m tests.vllm_greedy MODEL_DIR REQUEST.json`.

REQUEST.json: {"prompts": [[token ids], ...], "max_tokens": N, "dtype": "float32"}. Prints one JSON line:
{"architecture": <the model class vLLM resolved>, "outputs": [[token ids], ...]}. A separate process keeps
each engine's start and shutdown out of the test process.
"""

import json
import sys
from pathlib import Path

from eagle3_pipeline.config import EngineConfig, TargetConfig
from eagle3_pipeline.engine import start_engine

if __name__ == "__main__":
    model_dir, request = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    from vllm import SamplingParams

    engine = EngineConfig(max_model_len=512, max_num_seqs=4, enforce_eager=True, dtype=request["dtype"])
    llm = start_engine(TargetConfig(path=str(model_dir)), model_dir, engine)
    outputs = llm.generate(
        [{"prompt_token_ids": ids} for ids in request["prompts"]],
        SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True),
    )
    architecture = llm.llm_engine.model_config.architectures[0]
    print("RESULT " + json.dumps({"architecture": architecture, "outputs": [list(o.outputs[0].token_ids) for o in outputs]}))
