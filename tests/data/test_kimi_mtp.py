"""kimi-mtp-dataset records (schema `kimi_mtp`): Kimi-K2.5's own turns with reasoning and tool calls inline, and
images as JSON-encoded content parts, read into the same conversations as the OpenAI form of the same chat,
and laid out and loss-masked by the tiny Kimi's template exactly as that form is."""

from __future__ import annotations

import base64
import json

import pytest

from eagle3_pipeline.config_sections import DataConfig
from eagle3_pipeline.data.conversations import Conversation, InvalidConversation, to_messages, to_tools
from eagle3_pipeline.data.samples import to_row
from tests.data.test_tool_calls import (
    ARGUMENTS,
    FINAL,
    OPENAI_RECORD,
    QUESTION,
    TIME_RESULT,
    WEATHER_RESULT,
    kimi_call,
)

# OPENAI_RECORD's chat as Kimi-K2.5 wrote it: reasoning and tool calls inline, results in tool turns
KIMI_MTP_RECORD = {
    "source": "agentic",
    "tools": OPENAI_RECORD["tools"],
    "conversations": [
        {"from": "human", "value": QUESTION},
        {"from": "gpt", "value": "<think>First the weather.</think>" + kimi_call("functions.get_weather:0")},
        {"from": "tool", "value": WEATHER_RESULT},
        {"from": "gpt", "value": "<think>Then the time.</think>Now the time." + kimi_call("functions.get_time:1")},
        {"from": "tool", "value": TIME_RESULT},
        {"from": "gpt", "value": f"<think>Both are known.</think>{FINAL}"},
    ],
}
PIXEL = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()


def openai_form() -> dict:
    """OPENAI_RECORD with every call's arguments as the text Kimi wrote (a kimi-mtp record holds text)."""
    record = json.loads(json.dumps(OPENAI_RECORD))
    for message in record["messages"]:
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = ARGUMENTS
    return record


def test_inline_reasoning_and_tool_calls_become_the_openai_form():
    assert to_messages(KIMI_MTP_RECORD, "kimi_mtp") == to_messages(openai_form(), "messages")
    assert to_tools(KIMI_MTP_RECORD) == OPENAI_RECORD["tools"]


def test_the_tiny_kimis_rows_equal_those_of_the_openai_form(kimi):
    """The same ids and the same loss mask, token for token, in thinking and instant mode."""
    data = DataConfig(sources=[{"kind": "file", "name": "x.jsonl"}], max_seq_len=4096)
    rows = [to_row(Conversation("c-0", "c", to_messages(record, schema), tools=to_tools(record)), kimi, data,
                   with_prompt=False)
            for record, schema in ((KIMI_MTP_RECORD, "kimi_mtp"), (openai_form(), "messages"))]
    assert rows[0]["input_ids"].tolist() == rows[1]["input_ids"].tolist()
    assert rows[0]["loss_mask"].tolist() == rows[1]["loss_mask"].tolist()
    assert rows[0]["loss_tokens_by_kind"]["tool_call"] > 0


def test_a_json_encoded_user_turn_with_an_image_becomes_image_parts():
    parts = [{"type": "image_url", "image_url": {"url": PIXEL}}, {"type": "text", "text": "What is this?"}]
    record = {"conversations": [{"from": "human", "value": json.dumps(parts)},
                                {"from": "gpt", "value": "<think></think>A pixel."}]}
    assert to_messages(record, "kimi_mtp") == [
        {"role": "user", "content": [{"type": "image", "image": PIXEL}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A pixel."}]  # an empty reasoning block is no reasoning
    text_like_json = {"conversations": [{"from": "human", "value": '[{"a": 1}] is a list'},
                                        {"from": "gpt", "value": "Yes."}]}
    assert to_messages(text_like_json, "kimi_mtp")[0]["content"] == '[{"a": 1}] is a list'


@pytest.mark.parametrize(("value", "reason"), [
    ("<think>Hmm.</think><|tool_calls_section_begin|><|tool_call_begin|>functions.f:0", "malformed_tool_call"),
    ("<|tool_calls_section_begin|><|tool_call_begin|>f<|tool_call_argument_begin|>{}<|tool_call_end|>"
     "<|tool_calls_section_end|>", "malformed_tool_call"),  # no functions.NAME:IDX id
    ("<think>Only thoughts.</think>  ", "empty_content"),
])
def test_malformed_kimi_turns_are_skipped_by_reason(value, reason):
    with pytest.raises(InvalidConversation, match=reason):
        to_messages({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": value}]}, "kimi_mtp")


def test_stage_01_trains_a_kimi_mtp_file_as_written(tmp_path):
    """01 on the tiny Kimi, no regeneration: text, thinking, tool calls and an image read from a kimi-mtp file;
    a malformed row counted by reason; the reasoning and tool calls trained."""
    from PIL import Image

    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.data import stage as prepare_data
    from tests.conftest import CONFIGS

    Image.new("RGB", (28, 28), (200, 40, 40)).save(tmp_path / "red.png")
    picture = [{"type": "text", "text": "What colour is this?"},
               {"type": "image_url", "image_url": {"url": str(tmp_path / "red.png")}}]
    rows = [KIMI_MTP_RECORD,
            {"conversations": [{"from": "human", "value": json.dumps(picture)},
                               {"from": "gpt", "value": "<think>It is plain.</think>Red."}]},
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "<think>Hmm.</think>"}]}]
    records = tmp_path / "train-00000-of-00001.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load_config(CONFIGS / "tiny_kimi.yaml", [
        f"run_dir={tmp_path / 'run'}", f"data.sources=[{{kind: file, name: {records}, schema: kimi_mtp}}]",
        "data.eval_sources=[]", "data.eval_fraction=0.0", "data.regenerate.enabled=false", "data.max_seq_len=1024"])
    prepare_data.run(config)
    stats = json.loads((tmp_path / "run" / "01_data" / "stats.json").read_text())
    assert stats["skipped"] == {"empty_content": {"count": 1, "first_ids": ["train-00000-of-00001-2"]}}
    train = stats["train"]
    assert train["samples"] == 2 and train["image_tokens"] > 0
    assert all(train["loss_tokens_by_kind"][kind] > 0 for kind in ("reasoning", "answer", "tool_call"))
