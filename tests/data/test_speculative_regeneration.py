"""01 regenerating with a draft (data.regenerate.speculative) in vLLM CPU: the demo's exported draft on SmolLM2.

Two 01 runs on the same prompts at temperature 0, without and with the draft (one engine start each): the
answers are the same but for near-ties, and stats.json carries the draft's acceptance from vLLM's counters.

    python -m pytest -m vllm tests/data/test_speculative_regeneration.py -s    # -s prints the figures
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_pipeline.data.chat_template import ChatTemplate
from eagle3_pipeline.data.dataset import read_stats
from eagle3_pipeline.target import target_path
from tests.conftest import run_python
from tests.validate.runs import DEMO_HELD_OUT, DEMO_SAMPLES, demo_run
from tests.validate.smollm2_inputs import humaneval_chats

PROMPTS, MAX_TOKENS = 8, 32


def regenerate(path: Path, run_dir: Path, prompts: Path, *overrides: str) -> dict[str, str]:
    """01 on `prompts` into `run_dir`: {conversation id: the target's answer}."""
    result = run_python("01_prepare_data.py", "--config", str(path), "--set", f"run_dir={run_dir}",
                        "--set", f"data.sources=[{{kind: file, name: {prompts}}}]", "--set", "data.eval_sources=[]",
                        "--set", f"data.regenerate.max_tokens={MAX_TOKENS}", *overrides, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    print(result.stdout[-600:])
    records = [json.loads(line) for chunk in sorted((run_dir / "01_data" / "generated").glob("chunk-*.jsonl"))
               for line in chunk.read_text().splitlines()]
    return {record["id"]: record["messages"][-1]["completion"] for record in records}


def tie_margin(model, tokenizer, prompt_ids: list[int], plain: str, drafted: str) -> tuple[int, float]:
    """(first differing answer token, the target's logit margin there between the two runs' tokens)."""
    import torch

    a, b = (tokenizer.encode(text, add_special_tokens=False) for text in (plain, drafted))
    position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + a[:position]])).logits[0, -1].float()
    ends = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    token_a, token_b = (t[position] if position < len(t) else ends[0] for t in (a, b))
    return position, float(logits[token_a] - logits[token_b])


@pytest.mark.vllm
def test_regeneration_with_the_demo_draft_keeps_greedy_answers_and_counts_acceptance(tmp_path):
    config, path = demo_run(tmp_path)
    export = run_python("05_export.py", "--config", str(path), timeout=600)
    assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    draft = config.run_dir / "05_export" / "reference"
    chats = humaneval_chats(DEMO_SAMPLES)[-DEMO_HELD_OUT:][:PROMPTS]  # prompts the draft never trained on
    prompts = tmp_path / "prompts.jsonl"  # each answer a placeholder the target replaces
    prompts.write_text("".join(json.dumps({"messages": [*chat, {"role": "assistant", "content": "..."}]}) + "\n"
                               for chat in chats))

    plain = regenerate(path, tmp_path / "plain", prompts)
    drafted = regenerate(path, tmp_path / "drafted", prompts, "--set",
                         f"data.regenerate.speculative={{draft: {draft}, num_speculative_tokens: 3}}")

    assert plain.keys() == drafted.keys() and len(plain) == PROMPTS
    differing = [key for key in plain if plain[key] != drafted[key]]
    if differing:  # each one a near-tie of the target's, as 06 allows (validate.max_tie_margin)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model_dir = target_path(config.target)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        template = ChatTemplate.for_target(config.target, model_dir, thinking=True)
        for key in differing:
            prompt_ids = template.prompt_ids(chats[int(key.rsplit("-", 1)[1])])
            position, margin = tie_margin(model, tokenizer, prompt_ids, plain[key], drafted[key])
            print(f"{key}: differs at answer token {position}, target logit margin {margin:.3f}")
            assert abs(margin) <= config.validate_.max_tie_margin, (key, plain[key], drafted[key])
    print(f"{len(differing)} of {PROMPTS} answers differ with the draft")

    generation = read_stats(tmp_path / "drafted" / "01_data")["generation"]
    speculative = generation["speculative"]
    print(f"with the draft: {generation}")
    assert generation["tokens_generated"] > 0 and generation["tokens_per_s"] > 0
    assert speculative["num_speculative_tokens"] == 3 and speculative["num_drafts"] > 0
    assert speculative["mean_acceptance_length"] == pytest.approx(
        1 + speculative["num_accepted_tokens"] / speculative["num_drafts"], abs=1e-4)
    assert len(speculative["acceptance_per_position"]) == 3
    plain_generation = read_stats(tmp_path / "plain" / "01_data")["generation"]
    assert "speculative" not in plain_generation and plain_generation["tokens_per_s"] > 0
