"""01's reader and masker on generated records (hypothesis, fixed seed), for both stand-in targets.

Records in the ShareGPT and messages schemas with every defect a dataset can hold (unknown, missing and
non-string roles; empty, None, non-string, very long, unicode and control-character contents; OpenAI content
parts; system and tool turns; special-token text; missing keys; records that are no mapping at all) go through
the real file reader and the template masking. Every record is kept or counted under exactly one skip reason,
nothing raises, and every loss-masked span of a kept row decodes to text of the conversation's assistant turns
(the template's own markers aside: end of turn, reasoning brackets).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from eagle3_pipeline.config_sections import DataConfig, SourceConfig
from eagle3_pipeline.data.chat_template import REASONING_END, REASONING_START, ChatTemplate, load_tokenizer
from eagle3_pipeline.data.conversations import InvalidConversation, Skips
from eagle3_pipeline.data.samples import served_turns, to_rows
from eagle3_pipeline.data.sources import load_conversations

EXAMPLES = 400  # per target: 10-20 s each here
SPECIAL_TEXT = ["<|im_end|>", "<|im_start|>", "<|im_user|>", "<|im_middle|>", "<|im_assistant|>",
                REASONING_START, REASONING_END]
ROLE_NAMES = {"messages": "role", "sharegpt": "from"}
CONTENT_KEYS = {"messages": "content", "sharegpt": "value"}
ROLES = {"messages": ["system", "user", "assistant", "tool"],
         "sharegpt": ["system", "human", "user", "gpt", "assistant", "tool", "observation"]}

any_char = st.characters(codec="utf-8")  # every code point JSON can carry: control characters, emoji, CJK
words = st.text(any_char, min_size=1, max_size=40) | st.sampled_from(["Hi.", "2 + 2 = 4.", "  padded  ", "é漢字🙂",
                                                                      "a\x00b\x1b[0m", "line\r\nbreak"])
text = st.lists(words | st.sampled_from(SPECIAL_TEXT), min_size=1, max_size=4).map("".join).filter(str.strip)
long_text = st.integers(200, 1500).map(lambda n: "word " * n)
content = st.one_of(
    text, text, long_text, st.sampled_from(["", "   ", "\n\t"]), st.none(), st.integers(), st.booleans(),
    st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=3),  # OpenAI content parts
    st.lists(st.integers(), min_size=1, max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
SHAPES = ["chat"] * 4 + ["random_turns", "no_turn_list", "not_a_mapping"]  # mostly chats: kept rows get checked


@st.composite
def turn(draw, schema: str) -> dict | list:
    """One turn with any role (known, unknown, None, not a string) and any content; a key may be missing."""
    role = draw(st.sampled_from(ROLES[schema]) | st.sampled_from(["wizard", "", "Assistant"]) |
                st.none() | st.integers())
    fields = {ROLE_NAMES[schema]: role, CONTENT_KEYS[schema]: draw(content)}
    if draw(st.booleans()):
        fields["reasoning_content"] = draw(text | st.none() | st.integers())
    if draw(st.integers(0, 3)) == 0:
        del fields[draw(st.sampled_from(sorted(fields)))]
    return fields if draw(st.integers(0, 7)) else ["not", "a", "turn"]


@st.composite
def record(draw) -> object:
    schema = draw(st.sampled_from(["messages", "sharegpt"]))
    role_key, content_key = ROLE_NAMES[schema], CONTENT_KEYS[schema]
    key = "messages" if schema == "messages" else "conversations"
    shape = draw(st.sampled_from(SHAPES))
    if shape == "not_a_mapping":
        return draw(st.sampled_from([None, 3, "a string", [], [1, 2]]))
    if shape == "no_turn_list":
        return draw(st.sampled_from([{key: None}, {key: "text"}, {key: []}, {"other": [{role_key: "user"}]}]))
    if shape == "random_turns":
        turns = draw(st.lists(turn(schema), min_size=1, max_size=6))
    else:  # user/assistant rounds, now and then a reasoning, a tool turn, a random turn, no first turn
        user, assistant = ("user", "assistant") if schema == "messages" else ("human", "gpt")
        turns = []
        for _ in range(draw(st.integers(1, 3))):
            turns += [{role_key: user, content_key: draw(text | text | long_text)},
                      {role_key: assistant, content_key: draw(text)}]
            if draw(st.integers(0, 3)) == 0:
                turns[-1]["reasoning_content"] = draw(text)
        if draw(st.integers(0, 3)) == 0:
            turns.insert(draw(st.integers(0, len(turns) - 1)), {role_key: "tool", content_key: draw(text)})
        if draw(st.integers(0, 3)) == 0:
            turns[draw(st.integers(0, len(turns) - 1))] = draw(turn(schema))
        if draw(st.integers(0, 5)) == 0:  # it opens with an answer
            del turns[0]
    if draw(st.booleans()):
        turns.insert(0, {role_key: "system", content_key: draw(text)})
    return {key: turns}


def masked_spans(row: dict) -> list[list[int]]:
    """The runs of loss-masked token ids of a row."""
    tokens = zip(row["input_ids"].tolist(), row["loss_mask"].tolist())
    return [[token for token, _ in run] for trained, run in itertools.groupby(tokens, key=lambda t: t[1]) if trained]


def assistant_texts(messages: list[dict]) -> list[str]:
    return [m[key] for m in messages if m["role"] == "assistant"
            for key in ("content", "reasoning_content") if key in m]


def decode(template: ChatTemplate, ids: list[int]) -> str:
    return template.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def spelled(template: ChatTemplate, text: str) -> str:
    """`text` as the tokenizer gives it back: a byte its vocabulary lacks (SmolLM2 has none for 0xF1, the lead
    byte of U+40000) is lost in any sequence, so the mask is checked against what the tokens can spell."""
    return decode(template, template.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module", params=["smollm2", "tiny_kimi"])
def template(request, smollm2_dir, tiny_kimi_dir) -> ChatTemplate:
    model_dir = smollm2_dir if request.param == "smollm2" else tiny_kimi_dir
    return ChatTemplate(load_tokenizer(model_dir, trust_remote_code=False), {"thinking": True})


@pytest.fixture(scope="module")
def records_file(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("records") / "records.jsonl"


@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(records=st.lists(record(), min_size=1, max_size=4),
       schema=st.sampled_from(["auto"] * 3 + ["messages", "sharegpt"]), max_seq_len=st.sampled_from([16, 48, 2048, 2048]),
       overlong=st.sampled_from(["truncate", "drop"]), with_prompt=st.booleans())
def test_every_record_is_kept_or_skipped_once_and_masks_hold_only_assistant_text(
        template, records_file, records, schema, max_seq_len, overlong, with_prompt):
    records_file.write_text("".join(json.dumps(r) + "\n" for r in records))
    skips = Skips()
    source = SourceConfig.model_validate({"kind": "file", "name": str(records_file), "schema": schema})
    conversations = load_conversations(source, "records", skips)
    data = DataConfig(sources=[source], max_seq_len=max_seq_len, overlong=overlong)
    rows = to_rows(conversations, template, data, with_prompt=with_prompt, skips=skips, split="train")
    for outcome in [*skips.counts, "kept"] if rows else skips.counts:  # pytest --hypothesis-show-statistics
        event(outcome)

    # eval rows: one per served turn (samples.served_turns); a record that did not load is skipped once
    turns = [turn for c in conversations for turn in (served_turns(c) if with_prompt else [c])]
    assert len(rows) + sum(skips.counts.values()) == len(records) - len(conversations) + len(turns)
    assert len({row["id"] for row in rows}) == len(rows)
    messages = {turn.id: turn.messages for turn in turns}
    markers = re.compile("|".join(map(re.escape, [template.end_of_turn, REASONING_START, REASONING_END])))
    for row in rows:
        answered = any(m["role"] == "assistant" for m in messages[row["id"]])
        assert row["loss_mask"].any() == answered and len(row["input_ids"]) == row["seq_len"] <= max_seq_len
        assert with_prompt or answered  # a prompt without an answer is kept for eval alone
        allowed = [spelled(template, text) for text in assistant_texts(messages[row["id"]])]
        spans = masked_spans(row)
        for span in spans:
            decoded = decode(template, span)
            if row["truncated"] and span is spans[-1]:  # max_seq_len may cut a character's bytes
                decoded = decoded.rstrip("\ufffd")
            for part in filter(str.strip, markers.split(decoded)):
                assert any(part in text for text in allowed), (row["id"], decoded, allowed)
    for conversation in conversations:  # regeneration prompts the target with each answer's prefix
        for end in (i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"):
            with contextlib.suppress(InvalidConversation):
                template.prompt_ids(conversation.messages[:end])
