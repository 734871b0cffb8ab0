"""The stand-in against Kimi-K2.5's real tokenizer files (../shared/kimi_k25; never committed here): the tiny
Kimi's own tokenizer class and template render the 8 real conversations exactly as the real template and
tokenizer did, and the class loaded with the real ranks and config gives exactly their ids; 01 run with the real
files as the target's tokenizer masks thinking, tool calls and an image span by span. Under CI a missing folder
fails (tests/conftest.py `real_kimi_tokenizer_dir`)."""

from __future__ import annotations

import json
import shutil

import datasets
import pytest

from eagle3_pipeline.config import load_config
from eagle3_pipeline.data import stage as prepare_data
from eagle3_pipeline.data.chat_template import load_tokenizer
from eagle3_pipeline.data.dataset import read_stats
from eagle3_pipeline.stand_ins import ensure_stand_in
from eagle3_pipeline.stand_ins.tiny_kimi import write_image_chat
from tests.conftest import CONFIGS, REAL_KIMI_FILES

TOKENIZER_FILES = ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja", "tokenization_kimi.py",
                   "tokenizer.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def renders(real_kimi_tokenizer_dir) -> list[dict]:
    return [json.loads(line) for line in (REAL_KIMI_FILES / "renders_k25.jsonl").read_text().splitlines()]


def render(tokenizer, case: dict) -> str:
    kwargs = dict(case["template_kwargs"])
    generation_prompt = kwargs.pop("add_generation_prompt", True)
    return tokenizer.apply_chat_template(case["messages"], tools=case["tools"], tokenize=False,
                                         add_generation_prompt=generation_prompt, **kwargs)


def test_the_stand_ins_tokenizer_class_and_template_render_the_real_conversations(renders):
    tokenizer = load_tokenizer(ensure_stand_in("tiny-kimi-k25-tiktoken"), trust_remote_code=True)
    assert len(renders) == 8
    for case in renders:
        assert render(tokenizer, case) == case["rendered_real_k25"], case["case"]


def test_the_class_with_the_real_ranks_and_config_gives_the_real_ids(renders, real_kimi_tokenizer_dir):
    tokenizer = load_tokenizer(real_kimi_tokenizer_dir, trust_remote_code=True)
    for case in renders:
        text = render(tokenizer, case)
        assert text == case["rendered_real_k25"], case["case"]
        assert tokenizer.encode(text) == case["input_ids_real_tokenizer"], case["case"]


def test_the_fast_stand_in_differs_only_in_declaring_tools_as_json(renders):
    """tokenizer.json holds no code, so the fast form cannot write the TypeScript declaration."""
    tokenizer = load_tokenizer(ensure_stand_in("tiny-kimi-k25"), trust_remote_code=False)
    for case in renders:
        text, real = render(tokenizer, case), case["rendered_real_k25"]
        if not case["tools"]:
            assert text == real, case["case"]
            continue
        declaration = "<|im_system|>tool_declare<|im_middle|>"
        assert real.startswith(declaration + "# Tools\n\n## functions\nnamespace functions {\n")
        json_tools = json.dumps(case["tools"], separators=(",", ":"))
        assert text.startswith(f"{declaration}{json_tools}<|im_end|>")
        assert text.split("<|im_end|>", 1)[1] == real.split("<|im_end|>", 1)[1]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get weather for a city.",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}


def test_01_with_the_real_files_masks_thinking_tool_calls_and_an_image(real_kimi_tokenizer_dir, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(ensure_stand_in("tiny-kimi-k25"), target,
                    ignore=lambda _, names: [n for n in names if n in TOKENIZER_FILES])
    for path in real_kimi_tokenizer_dir.iterdir():
        shutil.copy(path, target / path.name)
    image = json.loads(write_image_chat(tmp_path).read_text())["messages"][0]["content"][1]
    record = {"tools": [WEATHER], "messages": [
        {"role": "user", "content": [image, {"type": "text", "text": "Weather where this was taken?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "It is Paris.",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C"},
        {"role": "assistant", "content": "18 C in Paris.", "reasoning_content": "The tool said 18 C."}]}
    (tmp_path / "chats.jsonl").write_text(json.dumps(record) + "\n")
    config = load_config(CONFIGS / "tiny_kimi.yaml", [
        f"run_dir={tmp_path / 'run'}", "target.stand_in=null", f"target.path={target}",
        f"data.sources=[{{kind: file, name: {tmp_path / 'chats.jsonl'}}}]", "data.eval_fraction=0",
        "data.regenerate.enabled=false", "data.max_seq_len=1024"])
    prepare_data.run(config)
    [row] = datasets.load_from_disk(str(tmp_path / "run" / "01_data" / "train")).to_list()
    tokenizer = load_tokenizer(target, trust_remote_code=True)
    spans, current = [], []
    for token, trained in zip(row["input_ids"] + [None], row["loss_mask"] + [0]):
        if trained:
            current.append(token)
        elif current:
            spans.append(tokenizer.decode(current, skip_special_tokens=False))
            current = []
    call = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    # trained: the tool step's reasoning and call, the final answer as served with its reasoning; never the
    # tool declaration, the user's text, the image or the tool's result
    assert spans == [f"It is Paris.</think>{call}<|im_end|>", "The tool said 18 C.</think>18 C in Paris.<|im_end|>"]
    text = tokenizer.decode(row["input_ids"], skip_special_tokens=False)
    assert text.startswith("<|im_system|>tool_declare<|im_middle|># Tools\n\n## functions\nnamespace functions {")
    assert "<|media_pad|>" in text and "## Return of functions.get_weather:0\n18 C" in text
    counts = read_stats(tmp_path / "run" / "01_data")["train"]["loss_tokens_by_kind"]
    count = lambda text: len(tokenizer.encode(text))  # noqa: E731
    assert counts == {"reasoning": count("It is Paris.</think>") + count("The tool said 18 C.</think>"),
                      "answer": count("18 C in Paris.<|im_end|>"), "tool_call": count(call + "<|im_end|>")}
