"""The SmolLM2 stand-in: a plain bf16 HF folder that vLLM serves exactly as transformers runs it."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.conftest import run_python

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a Python function that reverses a string."}],
    [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name three primary colors."}],
]
GREEDY_TOKENS = 16


def test_folder_is_a_bf16_llama_checkpoint_with_chat_template(smollm2_dir):
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.architectures == ["LlamaForCausalLM"] and config.num_hidden_layers == 30
    assert config.hidden_size == 576 and config.vocab_size == 49152
    assert getattr(config, "quantization_config", None) is None
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
        assert "model.embed_tokens.weight" in f.keys()
    assert dtypes == {"BF16"}
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    text = tokenizer.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_answers_like_an_instruct_model(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])


def hf_greedy(model_dir, prompts, max_new_tokens, dtype=torch.float32):
    """Plain argmax decoding with transformers' forward: no generation config, no logits processors."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            tokens = list(ids)
            for _ in range(max_new_tokens):
                logits = model(torch.tensor([tokens])).logits[0, -1]
                tokens.append(int(logits.argmax()))
            outputs.append(tokens[len(ids):])
    return outputs


def vllm_greedy(model_dir, prompts, max_tokens, tmp_path, dtype="float32"):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"prompts": prompts, "max_tokens": max_tokens, "dtype": dtype}))
    result = run_python("-m", "tests.vllm_greedy", str(model_dir), str(request), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.vllm
def test_vllm_greedy_matches_transformers(smollm2_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
               for chat in CHATS]
    served = vllm_greedy(smollm2_dir, prompts, GREEDY_TOKENS, tmp_path)
    assert served["architecture"] == "LlamaForCausalLM"
    reference = hf_greedy(smollm2_dir, prompts, GREEDY_TOKENS)
    for chat, got, want in zip(CHATS, served["outputs"], reference):
        assert got == want, f"{chat[-1]['content']!r}: vLLM {tokenizer.decode(got)!r} != HF {tokenizer.decode(want)!r}"
