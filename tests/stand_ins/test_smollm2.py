"""The SmolLM2 stand-in: a plain bf16 HF folder that vLLM serves exactly as transformers runs it."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tests.stand_ins.greedy import assert_same_greedy_tokens, vllm_chat_greedy

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


@pytest.mark.vllm
def test_vllm_greedy_matches_transformers(smollm2_dir, tmp_path):
    chats = [(messages, {}) for messages in CHATS]
    served = vllm_chat_greedy(smollm2_dir, chats, GREEDY_TOKENS, tmp_path)
    assert served["architecture"] == "LlamaForCausalLM"
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert_same_greedy_tokens(model, AutoTokenizer.from_pretrained(smollm2_dir), chats, served, GREEDY_TOKENS)
