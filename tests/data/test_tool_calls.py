"""Agentic conversations: tool calls trained, tool results and user text never; both dataset schemas."""

from __future__ import annotations

import json

import pytest

from eagle3_pipeline.config_sections import DataConfig
from eagle3_pipeline.data.chat_template import ChatTemplate, load_tokenizer
from eagle3_pipeline.data.conversations import Conversation, InvalidConversation, to_messages, to_tools
from eagle3_pipeline.data.dataset import read_stats
from eagle3_pipeline.data.generate import Rewrite
from eagle3_pipeline.data.samples import to_row
from eagle3_pipeline.data.stats import loss_kinds_summary, split_stats
from tests.data.test_chat_template import masked_spans

WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TIME = {"name": "get_time", "description": "Local time of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
QUESTION = "What is the weather in Paris, and what time is it there?"
WEATHER_RESULT, TIME_RESULT = "18 C, cloudy", "local time 14:05"
FINAL = "It is 18 C and cloudy in Paris; the local time is 14:05."
ARGUMENTS = '{"city": "Paris"}'

OPENAI_RECORD = {
    "tools": [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}],
    "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "reasoning_content": "First the weather.",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                         "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": WEATHER_RESULT},
        {"role": "assistant", "content": "Now the time.", "reasoning_content": "Then the time.",
         "tool_calls": [{"id": "functions.get_time:1", "type": "function",
                         "function": {"name": "get_time", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "functions.get_time:1", "content": TIME_RESULT},
        {"role": "assistant", "content": FINAL, "reasoning_content": "Both are known."},
    ],
}
SHAREGPT_RECORD = {
    "tools": json.dumps([WEATHER, TIME]),
    "conversations": [
        {"from": "human", "value": QUESTION},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": WEATHER_RESULT},
        {"from": "function_call", "value": json.dumps({"name": "get_time", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": TIME_RESULT},
        {"from": "gpt", "value": FINAL},
    ],
}


def kimi_call(call_id: str) -> str:
    """Kimi-K2.5's tool-call section for one call with ARGUMENTS, written out by hand."""
    return (f"<|tool_calls_section_begin|><|tool_call_begin|>{call_id}<|tool_call_argument_begin|>{ARGUMENTS}"
            "<|tool_call_end|><|tool_calls_section_end|>")


def read(record: dict) -> Conversation:
    return Conversation("agentic-0", "agentic", to_messages(record, "auto"), tools=to_tools(record))


def decoded_layout(template: ChatTemplate, conversation: Conversation) -> tuple[list[int], str, list[str]]:
    """(ids, decoded text, decoded masked spans) of a conversation laid out with its tools."""
    tools = conversation.tools

    class WithTools:  # masked_spans lays out messages; the tools travel with them here
        def __getattr__(self, name):
            return getattr(template, name)

        def layout(self, messages):
            return template.layout(messages, tools=tools)

    ids, spans = masked_spans(WithTools(), conversation.messages)
    return ids, template.tokenizer.decode(ids, skip_special_tokens=False), spans


@pytest.mark.parametrize("record", [OPENAI_RECORD, SHAREGPT_RECORD], ids=["openai", "sharegpt"])
def test_kimi_agentic_mask_is_exactly_what_the_assistant_generated(kimi, record):
    conversation = read(record)
    ids, text, spans = decoded_layout(kimi, conversation)
    thinking = kimi.template_kwargs["thinking"]
    recorded_reasoning = record is OPENAI_RECORD and thinking  # ShareGPT records carry no reasoning
    step_reasoning = ["First the weather.", "Then the time."] if recorded_reasoning else ["", ""]
    opener = "</think>" if thinking else ""  # in thinking mode the generation prompt opened <think>
    step_content = "Now the time." if record is OPENAI_RECORD else ""
    assert spans == [
        f"{step_reasoning[0]}{opener}{kimi_call('functions.get_weather:0')}<|im_end|>",
        f"{step_reasoning[1]}{opener}{step_content}{kimi_call('functions.get_time:1')}<|im_end|>",
        f"{'Both are known.' if recorded_reasoning else ''}{opener}{FINAL}<|im_end|>",  # the final answer as served:
    ]  # its reasoning too, which the template drops from a finished answer
    # the whole sequence is what the target was served for the final answer (the steps' reasoning kept),
    # then that answer; the tools, the user and the tool results are in it, untrained
    prompt = kimi.render(conversation.messages[:-1], generation_prompt=True, tools=conversation.tools)
    assert text == prompt + spans[-1]
    assert ids == kimi.tokenizer(text, add_special_tokens=False)["input_ids"]
    for untrained in (QUESTION, WEATHER_RESULT, TIME_RESULT, '"name":"get_weather"'):
        assert untrained in text and all(untrained not in span for span in spans)
    assert "## Return of functions.get_time:1\nlocal time 14:05<|im_end|>" in text


def test_kimi_agentic_loss_tokens_split_by_kind(kimi):
    data = DataConfig(sources=[{"kind": "file", "name": "x.jsonl"}], max_seq_len=4096)
    row = to_row(read(OPENAI_RECORD), kimi, data, with_prompt=False)
    tokens = kimi.tokenizer
    count = lambda text: len(tokens(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    thinking = kimi.template_kwargs["thinking"]
    reasoning = "First the weather.</think>Then the time.</think>Both are known.</think>" if thinking else ""
    calls = kimi_call("functions.get_weather:0") + kimi_call("functions.get_time:1") + "<|im_end|>" * 2
    assert row["loss_tokens_by_kind"] == {
        "reasoning": count(reasoning), "answer": count(f"Now the time.{FINAL}<|im_end|>"), "tool_call": count(calls)
    }
    assert sum(row["loss_tokens_by_kind"].values()) == row["loss_mask"].sum()
    stats = split_stats([row, row], data.max_seq_len)
    assert stats["loss_tokens_by_kind"] == {kind: 2 * n for kind, n in row["loss_tokens_by_kind"].items()}
    assert stats["image_tokens"] == 0
    assert loss_kinds_summary(stats).startswith(f"reasoning {2 * count(reasoning)} (")


def test_kimi_earlier_episode_reasoning_follows_what_the_template_keeps(kimi):
    """A second question after a finished agentic episode: the template drops the first episode's step
    reasoning from then on, so the layout does too; the last episode's steps keep theirs."""
    first = read(OPENAI_RECORD)
    messages = first.messages + [{"role": "user", "content": "And in Rome?"},
                                 {**first.messages[1], "reasoning_content": "Rome's weather."},
                                 first.messages[2], {"role": "assistant", "content": "Cloudy in Rome too."}]
    _, text, spans = decoded_layout(kimi, Conversation("c", "c", messages, tools=first.tools))
    thinking = kimi.template_kwargs["thinking"]
    assert ("First the weather." in text) is False
    assert ("Rome's weather." in spans[3]) is thinking
    assert len(spans) == 5 and spans[-1].endswith("Cloudy in Rome too.<|im_end|>")


def test_served_agentic_answer_keeps_the_reasoning_the_target_wrote(kimi):
    conversation = read(OPENAI_RECORD)
    completion = "Both are known.</think>" + FINAL
    conversation.messages[-1] |= {"completion": completion, "finished": True}
    _, text, spans = decoded_layout(kimi, conversation)
    prompt = kimi.render(conversation.messages[:-1], generation_prompt=True, tools=conversation.tools)
    assert spans[-1] == completion + "<|im_end|>" and text == prompt + spans[-1]


def test_template_without_tool_calls_skips_agentic_conversations(smollm2_dir):
    smollm2 = ChatTemplate(load_tokenizer(smollm2_dir, trust_remote_code=False), {})
    assert smollm2.tool_calls_start is None
    conversation = read(OPENAI_RECORD)
    with pytest.raises(InvalidConversation, match="tools_unsupported"):
        smollm2.layout(conversation.messages, tools=conversation.tools)
    # nor does it render the tools: a question about them, even answered without a call, would not show them
    assert not smollm2.renders_tools
    question = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": FINAL}]
    with pytest.raises(InvalidConversation, match="tools_unsupported"):
        smollm2.layout(question, tools=conversation.tools)
    assert smollm2.layout(question).segments


def regenerate(template: ChatTemplate, completions: list[str]) -> Rewrite:
    """The OpenAI record rewritten with `completions` as the target's turns, in order (each finished)."""
    rewrite = Rewrite(read(OPENAI_RECORD))
    for completion in completions:
        assert rewrite.needs_answer()
        rewrite.add_answer(template, completion, finished=True)
    assert not rewrite.needs_answer()
    return rewrite


def test_regenerated_tool_calls_equal_to_the_recorded_ones_keep_the_recorded_results(kimi):
    think = "Let me look.</think>" if kimi.template_kwargs["thinking"] else ""
    steps = [f"{think}{kimi_call('functions.get_weather:0')}", f"{think}Time next.{kimi_call('functions.get_time:1')}"]
    rewrite = regenerate(kimi, [*steps, f"{think}Mild, and 14:05."])
    recorded = read(OPENAI_RECORD).messages
    assert [m["role"] for m in rewrite.messages] == [m["role"] for m in recorded]
    assert [m.get("tool_calls") for m in rewrite.messages] == [m.get("tool_calls") for m in recorded]
    assert rewrite.messages[3]["content"] == "Time next."
    ids, text, spans = decoded_layout(kimi, Conversation("c", "c", rewrite.messages, tools=rewrite.conversation.tools))
    # the steps as the template renders them (kept in the final answer's prompt), the answer as written
    assert spans == [f"{step}<|im_end|>" for step in steps] + [f"{think}Mild, and 14:05.<|im_end|>"]
    assert WEATHER_RESULT in text and TIME_RESULT in text


def test_a_regenerated_tool_call_that_differs_ends_the_conversation_there(kimi):
    think = "Hmm.</think>" if kimi.template_kwargs["thinking"] else ""
    other_call = kimi_call("functions.get_weather:1")  # the recorded second step calls get_time
    rewrite = regenerate(kimi, [f"{think}{kimi_call('functions.get_weather:0')}", f"{think}{other_call}"])
    assert [m["role"] for m in rewrite.messages] == ["user", "assistant", "tool", "assistant"]
    _, text, spans = decoded_layout(kimi, Conversation("c", "c", rewrite.messages, tools=rewrite.conversation.tools))
    assert spans[-1] == f"{think}{other_call}<|im_end|>" and TIME_RESULT not in text
    # answering where the recording called a tool also ends it
    assert [m["role"] for m in regenerate(kimi, [f"{think}Sunny, I guess."]).messages] == ["user", "assistant"]


@pytest.mark.parametrize(("record", "reason"), [
    ({"messages": [{"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]},
     "malformed_tool_call"),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "function_call", "value": "{not json"}]},
     "malformed_tool_call"),
    ({"conversations": [{"from": "human", "value": "Hi"}, {"from": "observation", "value": "42"}]},
     "unanswerable_tool_result"),
    ({"messages": [{"role": "user", "content": "Hi"}], "tools": "{not json"}, "malformed_tools"),
    ({"messages": [{"role": "user", "content": "Draw a cat."},
                   {"role": "assistant", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]}]},
     "images_unsupported"),  # the draft never writes an image
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "malformed_image"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text"}]}]},
     "non_string_content"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]}, "non_string_content"),
])
def test_bad_agentic_records_are_skipped_by_reason(record, reason):
    with pytest.raises(InvalidConversation, match=reason):
        to_messages(record, "auto")
        to_tools(record)


def test_stage_01_reports_what_the_draft_learns_from_agentic_data(tmp_path, capsys):
    """01 on the tiny Kimi without regeneration: agentic records kept, a record whose image file is missing
    skipped by reason,
    stats.json and the printed summary split the loss tokens by kind."""
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.data import stage as prepare_data
    from tests.conftest import CONFIGS

    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]},
                          {"role": "assistant", "content": "A cat."}]}
    records = tmp_path / "agentic.jsonl"
    records.write_text("".join(json.dumps(r) + "\n" for r in (OPENAI_RECORD, SHAREGPT_RECORD, image)))
    config = load_config(CONFIGS / "tiny_kimi.yaml", [
        f"run_dir={tmp_path / 'run'}", f"data.sources=[{{kind: file, name: {records}}}]", "data.eval_sources=[]",
        "data.eval_fraction=0.0", "data.regenerate.enabled=false", "data.max_seq_len=1024"])
    prepare_data.run(config)
    stats = read_stats(tmp_path / "run" / "01_data")
    assert stats["skipped"] == {"unreadable_image": {"count": 1, "first_ids": ["agentic-2"]}}
    train = stats["train"]
    assert train["samples"] == 2 and train["image_tokens"] == 0
    assert sum(train["loss_tokens_by_kind"].values()) == train["loss_tokens"]
    assert all(n > 0 for n in train["loss_tokens_by_kind"].values())  # thinking mode: the steps' reasoning
    assert f"train loss tokens by kind: {loss_kinds_summary(train)}" in capsys.readouterr().out


def test_the_next_prompt_after_a_generated_turn_is_the_templates_rendering(kimi):
    """Regeneration's next prompt lays an earlier generated turn out as the template renders it (reasoning
    dropped), not as the raw completion: that is what the target is served."""
    think = "Short.</think>" if kimi.template_kwargs["thinking"] else ""
    rewrite = Rewrite(Conversation("c", "c", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "x"},
                                              {"role": "user", "content": "Bye"}]))
    assert rewrite.needs_answer()
    rewrite.add_answer(kimi, f"{think}Hello!", finished=True)
    assert rewrite.needs_answer()
    expected = kimi.render(rewrite.messages, generation_prompt=True)
    assert kimi.tokenizer.decode(kimi.prompt_ids(rewrite.messages), skip_special_tokens=False) == expected


def test_sharegpt_parallel_calls_get_kimi_ids_and_results_answer_them_in_order():
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": "{}"}]
    messages = to_messages({"conversations": [
        {"from": "human", "value": QUESTION}, {"from": "function_call", "value": json.dumps(calls)},
        {"from": "observation", "value": WEATHER_RESULT}, {"from": "observation", "value": TIME_RESULT},
        {"from": "gpt", "value": FINAL}]}, "sharegpt")
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["functions.get_weather:0", "functions.get_time:1"]
    assert [c["function"]["arguments"] for c in messages[1]["tool_calls"]] == [{"city": "Paris"}, "{}"]
    assert [(m["tool_call_id"], m["content"]) for m in messages[2:4]] == [
        ("functions.get_weather:0", WEATHER_RESULT), ("functions.get_time:1", TIME_RESULT)]
