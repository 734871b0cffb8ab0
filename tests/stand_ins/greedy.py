"""Greedy decoding by vLLM and by transformers on the same chats, for the stand-in equivalence tests.

vLLM runs in its own process (`python -m tests.stand_ins.greedy MODEL_DIR REQUEST.json OUT.json`): it
spawns its engine, so the code building `LLM` sits under a `__main__` guard, and each engine's start and
shutdown stay out of the test process. Both sides run in float32: in bf16 the two implementations round
differently and near-tied argmaxes of a random model flip within a few tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from eagle3_pipeline.config_sections import TargetConfig
from eagle3_pipeline.engine import start_engine
from tests.conftest import run_python


def vllm_chat_greedy(model_dir: Path, chats: list[tuple[list[dict], dict]], max_tokens: int, tmp_path: Path,
                     **engine_kwargs) -> dict:
    """{"architecture": the model class vLLM ran, "results": [{"prompt_ids", "generated"}, ...]}."""
    request, out = tmp_path / "request.json", tmp_path / "vllm.json"
    request.write_text(json.dumps({"chats": chats, "max_tokens": max_tokens, "engine": engine_kwargs}))
    result = run_python("-m", "tests.stand_ins.greedy", str(model_dir), str(request), str(out), timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return json.loads(out.read_text())


def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """Plain argmax decoding with full forward passes (no generation config, no logits processors);
    also returns each step's logits to explain a divergence."""
    ids = torch.tensor([prompt_ids])
    tokens, step_logits = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1]
            tokens.append(int(logits.argmax()))
            step_logits.append(logits)
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, step_logits


def divergence_report(hf_tokens: list[int], vllm_tokens: list[int], step_logits: list[torch.Tensor]) -> str:
    step = next(i for i, (a, b) in enumerate(zip(hf_tokens, vllm_tokens)) if a != b)
    gap = float(step_logits[step][hf_tokens[step]] - step_logits[step][vllm_tokens[step]])
    return (f"first divergence at step {step}: HF {hf_tokens[step]} vs vLLM {vllm_tokens[step]}, "
            f"HF logit gap between them {gap:.4f}\nHF   {hf_tokens}\nvLLM {vllm_tokens}")


def assert_same_greedy_tokens(model, tokenizer, chats, served: dict, max_tokens: int) -> None:
    for (messages, kwargs), result in zip(chats, served["results"]):
        hf_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False, **kwargs)
        assert result["prompt_ids"] == hf_prompt, "vLLM rendered another prompt than the tokenizer's template"
        hf_tokens, step_logits = hf_greedy(model, result["prompt_ids"], max_tokens)
        assert hf_tokens == result["generated"], f"{messages[-1]['content']!r} {kwargs}: " + divergence_report(
            hf_tokens, result["generated"], step_logits)


def _generate(model_dir: str, request_path: str, out_path: str) -> None:
    from vllm import SamplingParams

    request = json.loads(Path(request_path).read_text())
    llm = start_engine(TargetConfig(path=model_dir), Path(model_dir), dtype="float32", enforce_eager=True,
                       max_model_len=512, **request["engine"])
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
    results = []
    for messages, kwargs in request["chats"]:
        out = llm.chat([messages], params, chat_template_kwargs=kwargs, use_tqdm=False)[0]
        results.append({"prompt_ids": list(out.prompt_token_ids), "generated": list(out.outputs[0].token_ids)})
    architecture = llm.llm_engine.model_config.architecture
    Path(out_path).write_text(json.dumps({"architecture": architecture, "results": results}))


if __name__ == "__main__":
    _generate(*sys.argv[1:])
