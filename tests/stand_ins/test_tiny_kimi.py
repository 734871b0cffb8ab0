"""Tests for the tiny Kimi-K2.5 stand-in (`eagle3_pipeline.stand_ins.tiny_kimi`).

Fast tests check the folder: determinism, both tokenizers (the fast one and Kimi's remote-code
tiktoken one: the same ids), chat template, checkpoint layout, and that transformers loads it. The
`vllm` test starts vLLM CPU once, in a subprocess (vLLM spawns its engine, so the code that builds
`LLM` must sit under a `__main__` guard), and compares its greedy tokens with transformers' on the
same prompt ids (the remote-code tokenizer is served by tests/test_pipeline_tiny_kimi.py).

    python -m pytest -p no:cacheprovider tests/stand_ins/test_tiny_kimi.py            # all
    python -m pytest -p no:cacheprovider -m vllm tests/stand_ins/test_tiny_kimi.py    # vLLM only
"""

from __future__ import annotations

import hashlib
import json
import pathlib

import pytest

from eagle3_pipeline.data.chat_template import load_tokenizer
from eagle3_pipeline.stand_ins import ensure_stand_in
from eagle3_pipeline.stand_ins.tiny_kimi import build
from eagle3_pipeline.stand_ins.tiny_kimi_tokenizer import ASSETS
from tests.stand_ins.greedy import assert_same_greedy_tokens, vllm_chat_greedy

# Kimi-K2 / K2.5 token ids, from moonshotai's tokenizer_config.json (added_tokens_decoder).
REAL_TOKEN_IDS = {
    "[BOS]": 163584,
    "[EOS]": 163585,
    "<|im_end|>": 163586,
    "<|im_user|>": 163587,
    "<|im_assistant|>": 163588,
    "<|im_system|>": 163594,
    "<|tool_calls_section_begin|>": 163595,
    "<|tool_calls_section_end|>": 163596,
    "<|tool_call_begin|>": 163597,
    "<|tool_call_argument_begin|>": 163598,
    "<|tool_call_end|>": 163599,
    "<|im_middle|>": 163601,
    "<|media_begin|>": 163602,
    "<|media_content|>": 163603,
    "<|media_end|>": 163604,
    "<|media_pad|>": 163605,
    "<think>": 163606,
    "</think>": 163607,
    "[PAD]": 163839,
}
GREEDY_TOKENS = 16


@pytest.fixture(scope="module")
def model_dir(tiny_kimi_dir) -> pathlib.Path:
    return tiny_kimi_dir


@pytest.fixture(scope="module")
def fast_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tiktoken_tokenizer():
    return load_tokenizer(ensure_stand_in("tiny-kimi-k25-tiktoken"), trust_remote_code=True)


@pytest.fixture(scope="module", params=["fast", "tiktoken"])
def tokenizer(request, fast_tokenizer, tiktoken_tokenizer):
    return fast_tokenizer if request.param == "fast" else tiktoken_tokenizer


def _file_hashes(folder: pathlib.Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("name, form", [("tiny-kimi-k25", "fast"), ("tiny-kimi-k25-tiktoken", "tiktoken")])
def test_build_is_deterministic(name, form, tmp_path):
    build(tmp_path, tokenizer=form)
    assert _file_hashes(tmp_path) == _file_hashes(ensure_stand_in(name))


# --- tokenizer and chat template ---------------------------------------------------------------


@pytest.mark.parametrize("token, token_id", sorted(REAL_TOKEN_IDS.items()))
def test_special_token_encodes_to_its_real_id(tokenizer, token, token_id):
    assert tokenizer.encode(token, add_special_tokens=False) == [token_id]
    # also inside text, where a generic backend would split "<think>" into ordinary pieces
    ids = tokenizer.encode(f"a{token}b", add_special_tokens=False)
    assert ids.count(token_id) == 1
    assert tokenizer.decode([token_id]) == token


def test_tokenizer_and_config_agree_on_kimi_ids(model_dir, tokenizer):
    config = json.loads((model_dir / "config.json").read_text())
    assert len(tokenizer) == config["text_config"]["vocab_size"] == 163840
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (163584, 163585, 163839)
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (163584, 163585, 163839)
    assert config["media_placeholder_token_id"] == REAL_TOKEN_IDS["<|media_pad|>"]


def _tool_call_conversation() -> list[dict]:
    """Two finished turns with reasoning, then a tool-call step of the turn in progress."""
    call = {"id": "functions.add:0", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 12, "b": 30}'}}
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        {"role": "user", "content": "What is 12+30?"},
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "functions.add:0", "content": "42"},
    ]


def _expected_tool_call_prompt(reasoning_of_tool_step: str, generation_prompt: str) -> str:
    return (
        "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"  # history: stripped
        "<|im_user|>user<|im_middle|>What is 12+30?<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|><think>{reasoning_of_tool_step}</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.add:0"
        '<|tool_call_argument_begin|>{"a": 12, "b": 30}<|tool_call_end|><|tool_calls_section_end|><|im_end|>'
        "<|im_system|>tool<|im_middle|>## Return of functions.add:0\n42<|im_end|>"
        f"<|im_assistant|>assistant<|im_middle|>{generation_prompt}"
    )


def test_chat_template_thinking_mode_keeps_reasoning_of_the_turn_in_progress(tokenizer):
    text = tokenizer.apply_chat_template(_tool_call_conversation(), tokenize=False, add_generation_prompt=True)
    assert text == _expected_tool_call_prompt("Use the tool.", "<think>")


def test_chat_template_instant_mode_drops_all_reasoning(tokenizer):
    text = tokenizer.apply_chat_template(
        _tool_call_conversation(), tokenize=False, add_generation_prompt=True, thinking=False
    )
    assert text == _expected_tool_call_prompt("", "<think></think>")


def test_chat_template_finished_conversation_keeps_no_reasoning(tokenizer):
    """As Kimi's template does: the last plain answer counts as history, so a finished
    conversation renders with empty think blocks (a data pipeline must not rely on the
    template to keep reasoning). Without a system message none is added (K2.5 adds none)."""
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Goodbye!", "reasoning_content": "A farewell."},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert text == (
        "<|im_user|>user<|im_middle|>Hi<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think></think>Hello!<|im_end|>"
        + "<|im_user|>user<|im_middle|>Bye<|im_end|>"
        + "<|im_assistant|>assistant<|im_middle|><think></think>Goodbye!<|im_end|>"
    )


def test_chat_template_declares_tools_first(tokenizer, tiktoken_tokenizer):
    """The remote-code tokenizer declares them in TypeScript, as Kimi-K2.5's does; the fast one (no code) as the
    template's compact JSON."""
    tools = [{"function": {"name": "add", "parameters": {"type": "object"}}, "type": "function"}]  # keys sorted
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tools=tools, tokenize=False,
                                         add_generation_prompt=False)
    declared = ("# Tools\n\n## functions\nnamespace functions {\ntype add = () => any;\n}\n"
                if tokenizer is tiktoken_tokenizer else
                '[{"function":{"name":"add","parameters":{"type":"object"}},"type":"function"}]')
    assert text == (f"<|im_system|>tool_declare<|im_middle|>{declared}<|im_end|>"
                    "<|im_user|>user<|im_middle|>Hi<|im_end|>")


# --- the remote-code tokenizer ------------------------------------------------------------------


def test_remote_code_tokenizer_is_kimis_class_in_a_folder_like_the_real_one(tiktoken_tokenizer):
    folder = ensure_stand_in("tiny-kimi-k25-tiktoken")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["auto_map"] == {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    assert not (folder / "tokenizer.json").exists() and (folder / "tiktoken.model").is_file()
    assert type(tiktoken_tokenizer).__name__ == "TikTokenTokenizer" and len(tiktoken_tokenizer) == 163840


def test_remote_code_tokenizer_gives_the_fast_ids(fast_tokenizer, tiktoken_tokenizer):
    texts = [*(ASSETS / "bpe_corpus.txt").read_text().split("\n\n"),
             "Prices: 12345 yen, 3.14159; CAPS and MixedCase, don't!  \n\n\t中文字符 école 🙂 <|unused_4242|>"]
    for text in texts:
        ids = fast_tokenizer.encode(text, add_special_tokens=False)
        assert tiktoken_tokenizer.encode(text, add_special_tokens=False) == ids, text
        assert tiktoken_tokenizer.encode(text) == ids, text  # tiktoken's own path
        assert tiktoken_tokenizer.decode(ids) == fast_tokenizer.decode(ids) == text
    # the ids a random model may emit decode alike, specials included
    every_kind = [0, 255, 4000, 4095, 9999, 163583, 163584, 163606, 163700, 163839]
    assert tiktoken_tokenizer.decode(every_kind) == fast_tokenizer.decode(every_kind)


def test_remote_code_tokenizer_sorts_tool_keys_and_keeps_kimis_defaults(tiktoken_tokenizer, fast_tokenizer):
    """As Kimi's tokenization_kimi.py: tool declarations render with sorted keys, and without arguments
    apply_chat_template returns text with the generation prompt; skip_special_tokens drops only the
    chat-format tokens, so vLLM's reasoning and tool parsers still see <think> and the tool-call markers."""
    tools = [{"type": "function", "function": {"parameters": {"type": "object", "properties": {
        "b": {"type": "integer"}, "a": {"type": "integer"}}}, "name": "add"}}]
    chat = [{"role": "user", "content": "Hi"}]
    text = tiktoken_tokenizer.apply_chat_template(chat, tools=tools)
    assert "type add = (_: {\n  a?: number,\n  b?: number\n}) => any;" in text  # sorted properties
    assert text.endswith("<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>")
    ids = tiktoken_tokenizer.encode("<|im_user|>Hi<|im_end|><think>x</think><|tool_calls_section_begin|>")
    assert tiktoken_tokenizer.decode(ids, skip_special_tokens=True) == "Hi<think>x</think><|tool_calls_section_begin|>"


# --- checkpoint --------------------------------------------------------------------------------


def test_checkpoint_has_shards_index_and_moonshot_names(model_dir):
    from safetensors import safe_open

    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(model_dir.glob("*.safetensors"))
    assert len(shards) >= 3
    stored = {}
    for shard in shards:
        with safe_open(shard, "pt") as f:
            stored |= {name: shard.name for name in f.keys()}
            assert {f.get_slice(n).get_dtype() for n in f.keys()} == {"BF16"}
    assert stored == index["weight_map"]

    for name in ("language_model.model.embed_tokens.weight", "language_model.model.norm.weight",
                 "language_model.lm_head.weight", "vision_tower.encoder.blocks.0.wqkv.weight",
                 "mm_projector.proj.0.weight"):
        assert name in stored
    config = json.loads((model_dir / "config.json").read_text())["text_config"]
    moe_layers = range(config["first_k_dense_replace"], config["num_hidden_layers"])
    for i in moe_layers:
        assert f"language_model.model.layers.{i}.mlp.gate.e_score_correction_bias" in stored
    assert not [n for n in stored if n.startswith("language_model.") and ".blocks." in n]


def test_config_shape(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k25" and not config["tie_word_embeddings"]
    layers = text["num_hidden_layers"]
    assert len({2, layers // 2, layers - 3}) == 3  # default EAGLE-3 aux layer ids are distinct
    assert text["kv_lora_rank"] + text["qk_rope_head_dim"] == 576  # vLLM CPU MLA
    assert (text["scoring_func"], text["topk_method"]) == ("sigmoid", "noaux_tc")


def test_transformers_loads_it_without_remote_code(model_dir):
    import torch
    from transformers import AutoModelForImageTextToText

    model, info = AutoModelForImageTextToText.from_pretrained(model_dir, output_loading_info=True)
    assert type(model).__name__ == "Kimi_K25ForConditionalGeneration"
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    assert not torch.equal(model.lm_head.weight, model.get_input_embeddings().weight)


# --- vLLM vs transformers ----------------------------------------------------------------------

def _tool_step_for_vllm() -> list[dict]:
    """The tool-call conversation, its reasoning also under `reasoning`: vLLM's chat parser forwards
    only that key (as reasoning_content) and drops a message's own `reasoning_content`."""
    messages = _tool_call_conversation()
    messages[4]["reasoning"] = messages[4]["reasoning_content"]
    return messages


CONVERSATIONS = [  # (messages, chat template kwargs): instant, default (thinking), thinking mid-turn
    ([{"role": "user", "content": "What is the capital of France?"}], {"thinking": False}),
    ([{"role": "system", "content": "You are terse."},
      {"role": "user", "content": "What is 12 times 12?"},
      {"role": "assistant", "content": "144.", "reasoning_content": "12*12=144"},
      {"role": "user", "content": "And 13 times 13?"}], {}),
    (_tool_step_for_vllm(), {"thinking": True}),
]


@pytest.mark.vllm
def test_vllm_greedy_matches_transformers(model_dir, fast_tokenizer, tmp_path):
    import torch
    from transformers import AutoModelForImageTextToText

    # text only: no vision profiling run at start-up
    served = vllm_chat_greedy(model_dir, CONVERSATIONS, GREEDY_TOKENS, tmp_path, limit_mm_per_prompt={"vision_chunk": 0})
    assert served["architecture"] == "KimiK25ForConditionalGeneration"
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert_same_greedy_tokens(model, fast_tokenizer, CONVERSATIONS, served, GREEDY_TOKENS)
