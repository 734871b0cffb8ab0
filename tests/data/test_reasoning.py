"""Data the target already wrote trains its reasoning: the last answer laid out as served whatever shape its
reasoning came in (four field names, inline with or without its `<think>`), kimi-mtp-dataset's real row shapes
(tool turns, `<|image|>` placeholders), one sample per assistant turn on request, and a report that names a
missing reasoning share. Checked token by token through the tiny Kimi's template and through Kimi-K2.5's real
tokenizer files (../shared/kimi_k25)."""

from __future__ import annotations

import json

import pytest

from eagle3_pipeline.config import load_config
from eagle3_pipeline.config_sections import DataConfig
from eagle3_pipeline.data import stage as prepare_data
from eagle3_pipeline.data.chat_template import ChatTemplate, load_tokenizer
from eagle3_pipeline.data.conversations import Conversation, InvalidConversation, Skips, to_messages
from eagle3_pipeline.data.dataset import read_stats
from eagle3_pipeline.data.samples import to_row, to_rows
from eagle3_pipeline.data.stats import reasoning_report
from tests.conftest import CONFIGS
from tests.data.test_stage import write_jsonl

REASONING, ANSWER = "Six times seven: 42.", "It is 42."
QUESTION = "What is 6 x 7?"
DATA = DataConfig(sources=[{"kind": "file", "name": "x.jsonl"}], max_seq_len=4096)


def openai(assistant: dict) -> dict:
    return {"messages": [{"role": "user", "content": QUESTION}, {"role": "assistant", **assistant}]}


def sharegpt(assistant: dict) -> dict:
    turn = {"from": "gpt", **{("value" if k == "content" else k): v for k, v in assistant.items()}}
    return {"conversations": [{"from": "human", "value": QUESTION}, turn]}


# every shape a last answer's reasoning comes in, in each schema that reads it
SHAPES = {
    **{f"messages-{field}": ("messages", openai({"content": ANSWER, field: REASONING}))
       for field in ("reasoning_content", "reasoning", "thinking", "thinking_content")},
    "messages-inline": ("messages", openai({"content": f"<think>{REASONING}</think>{ANSWER}"})),
    "sharegpt-thinking": ("sharegpt", sharegpt({"content": ANSWER, "thinking": REASONING})),
    "sharegpt-inline": ("sharegpt", sharegpt({"content": f"<think>{REASONING}</think>{ANSWER}"})),
    "kimi_mtp-inline": ("kimi_mtp", sharegpt({"content": f"<think>{REASONING}</think>{ANSWER}"})),
    "kimi_mtp-opener-dropped": ("kimi_mtp", sharegpt({"content": f"{REASONING}</think>{ANSWER}"})),
    "kimi_mtp-reasoning_content": ("kimi_mtp", sharegpt({"content": ANSWER, "reasoning_content": REASONING})),
}


@pytest.fixture(scope="module", params=["tiny-kimi", "real-k25"])
def thinking_kimi(request, tiny_kimi_dir) -> ChatTemplate:
    """Kimi's template in thinking mode: the tiny Kimi's, and Kimi-K2.5's real files."""
    if request.param == "tiny-kimi":
        return ChatTemplate(load_tokenizer(tiny_kimi_dir, trust_remote_code=False), {"thinking": True})
    folder = request.getfixturevalue("real_kimi_tokenizer_dir")
    return ChatTemplate(load_tokenizer(folder, trust_remote_code=True), {"thinking": True})


def trained(template: ChatTemplate, row: dict) -> list[str]:
    """The decoded runs of loss-masked tokens of a row."""
    spans, current = [], []
    for token, mask in zip(list(row["input_ids"]) + [None], list(row["loss_mask"]) + [0]):
        if mask:
            current.append(int(token))
        elif current:
            spans.append(template.tokenizer.decode(current, skip_special_tokens=False))
            current = []
    return spans


def count(template: ChatTemplate, text: str) -> int:
    return len(template.tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("shape", SHAPES)
def test_the_last_answer_trains_its_reasoning_whatever_shape_it_came_in(thinking_kimi, shape):
    schema, record = SHAPES[shape]
    row = to_row(Conversation("r-0", "r", to_messages(record, schema)), thinking_kimi, DATA, with_prompt=False)
    # as the target served it: the generation prompt ends with <think>, then everything after is its own
    assert trained(thinking_kimi, row) == [f"{REASONING}</think>{ANSWER}<|im_end|>"]
    prompt = thinking_kimi.render([{"role": "user", "content": QUESTION}], generation_prompt=True)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><think>")
    expected_ids = thinking_kimi.tokenizer(prompt + trained(thinking_kimi, row)[0], add_special_tokens=False)
    assert list(row["input_ids"]) == expected_ids["input_ids"]
    assert row["loss_tokens_by_kind"] == {"reasoning": count(thinking_kimi, f"{REASONING}</think>"),
                                          "answer": count(thinking_kimi, f"{ANSWER}<|im_end|>"), "tool_call": 0}


def test_instant_mode_serves_no_reasoning(tiny_kimi_dir):
    instant = ChatTemplate(load_tokenizer(tiny_kimi_dir, trust_remote_code=False), {"thinking": False})
    record = openai({"content": ANSWER, "reasoning_content": REASONING})
    row = to_row(Conversation("r-0", "r", to_messages(record, "messages")), instant, DATA, with_prompt=False)
    assert trained(instant, row) == [f"{ANSWER}<|im_end|>"]


KIMI_MTP_AGENTIC = {  # a kimi-mtp-dataset row: an image in the question, a tool step, the tool's result, the answer
    "images": ["PICTURE"],
    "conversations": [
        {"from": "human", "value": "<|image|>Where is this? Check the weather there."},
        {"from": "gpt", "value": "<think>It shows Paris.</think><|tool_calls_section_begin|><|tool_call_begin|>"
                                 "functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}"
                                 "<|tool_call_end|><|tool_calls_section_end|>"},
        {"from": "tool", "value": "18 C, cloudy"},
        {"from": "gpt", "value": "It is cloudy.</think>Paris, 18 C and cloudy."},  # its <think> dropped upstream
    ],
}


def test_kimi_mtp_rows_take_their_image_tool_turns_and_both_reasonings(thinking_kimi, tmp_path):
    record = dict(KIMI_MTP_AGENTIC, images=[str(tmp_path / "picture.png")])
    messages = to_messages(record, "kimi_mtp")
    assert messages[0]["content"] == [{"type": "image", "image": record["images"][0]},
                                      {"type": "text", "text": "Where is this? Check the weather there."}]
    assert messages[2] == {"role": "tool", "content": "18 C, cloudy", "tool_call_id": "functions.get_weather:0"}
    segments = thinking_kimi.layout(messages).segments
    spans = [segment.text for segment in segments if segment.trained]
    call = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    # the tool step as the template keeps it, the final answer as served: both reasonings trained, by kind
    assert spans == ["It shows Paris.</think>", call + "<|im_end|>", "It is cloudy.</think>",
                     "Paris, 18 C and cloudy.<|im_end|>"]
    assert [s.kind for s in segments if s.trained] == ["reasoning", "tool_call", "reasoning", "answer"]
    untrained = "".join(segment.text for segment in segments if not segment.trained)
    assert "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" in untrained
    assert "## Return of functions.get_weather:0\n18 C, cloudy" in untrained


@pytest.mark.parametrize("images,reason", [(None, "image_missing"), ([], "image_missing"), ([7], "malformed_image")])
def test_an_image_placeholder_without_its_image_is_skipped_by_reason(images, reason):
    record = {key: value for key, value in KIMI_MTP_AGENTIC.items() if key != "images"}
    if images is not None:
        record["images"] = images
    with pytest.raises(InvalidConversation, match=reason):
        to_messages(record, "kimi_mtp")


TWO_TURNS = Conversation("two-0", "two", [
    {"role": "user", "content": "First question?"},
    {"role": "assistant", "content": "First answer.", "reasoning_content": "First thought."},
    {"role": "user", "content": "Second question?"},
    {"role": "assistant", "content": "Second answer.", "reasoning_content": "Second thought."},
])


def test_each_assistant_turn_is_a_sample_laid_out_as_served(thinking_kimi):
    whole = to_rows([TWO_TURNS], thinking_kimi, DATA, with_prompt=False, skips=Skips(), split="train")
    # one sample: the first answer as history renders it (its reasoning dropped), the last as served
    assert [trained(thinking_kimi, row) for row in whole] == [
        ["</think>First answer.<|im_end|>", "Second thought.</think>Second answer.<|im_end|>"]]
    each = DataConfig(**DATA.model_dump(by_alias=True) | {"each_assistant_turn": True})
    per_turn = to_rows([TWO_TURNS], thinking_kimi, each, with_prompt=False, skips=Skips(), split="train")
    assert [row["id"] for row in per_turn] == ["two-0-turn1", "two-0-turn2"]
    assert [trained(thinking_kimi, row) for row in per_turn] == [
        ["First thought.</think>First answer.<|im_end|>"], ["Second thought.</think>Second answer.<|im_end|>"]]


def test_the_report_warns_when_a_thinking_template_trains_little_or_no_reasoning():
    plain = Conversation("p-0", "p", [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "A."}])
    train = {"loss_tokens": 100, "loss_tokens_by_kind": {"reasoning": 5, "answer": 95, "tool_call": 0}}
    none = reasoning_report(True, [plain], train)
    assert none["source_share_characters"] == 0 and "hold no reasoning" in none["warning"]
    assert reasoning_report(False, [plain], train)["warning"] is None  # a template that does not think
    thoughtful = reasoning_report(True, [TWO_TURNS], train)  # half its characters are reasoning, 5% trained
    assert thoughtful["trained_share_tokens"] == 0.05 and "data.each_assistant_turn" in thoughtful["warning"]
    assert reasoning_report(True, [TWO_TURNS], train | {"loss_tokens_by_kind": {
        "reasoning": 40, "answer": 60, "tool_call": 0}})["warning"] is None


def test_01_reports_the_reasoning_it_trains_and_warns_loudly(tmp_path, capsys):
    records = [openai({"content": ANSWER}), openai({"content": ANSWER, "reasoning_content": REASONING})]
    for name, chosen in (("plain", records[:1]), ("thinking", records)):
        data = write_jsonl(tmp_path / f"{name}.jsonl", chosen)
        config = load_config(CONFIGS / "tiny_kimi.yaml", [
            f"run_dir={tmp_path / name}", f"data.sources=[{{kind: file, name: {data}}}]", "data.eval_fraction=0",
            "data.regenerate.enabled=false", "target.stand_in=tiny-kimi-k25", "target.trust_remote_code=false"])
        prepare_data.run(config)
        report = read_stats(tmp_path / name / "01_data")["reasoning"]
        out = capsys.readouterr().out
        assert report["template_thinks"] is True
        if name == "plain":
            assert report["warning"] and f"WARNING: {report['warning']}" in out
        else:
            assert report["warning"] is None and report["trained_share_tokens"] > 0.2
    stats = read_stats(tmp_path / "thinking" / "01_data")
    assert stats["train"]["tokens_per_sample"] > 0 and stats["train"]["bytes_per_sample"] > 0
    assert json.loads(json.dumps(stats))["train"]["loss_tokens_by_kind"]["reasoning"] == count(
        ChatTemplate(load_tokenizer(prepare_data.target_path(config.target), False), {}), f"{REASONING}</think>") + 1
