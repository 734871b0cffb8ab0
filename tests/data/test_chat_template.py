"""Loss masks from the template's own renderings, checked against the tokenizer's rendering and decoding."""

from __future__ import annotations

import pytest

from eagle3_pipeline.data.chat_template import ChatTemplate, load_tokenizer
from eagle3_pipeline.data.conversations import InvalidConversation

MULTI_TURN = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "Hi, who are you?"},
    {"role": "assistant", "content": "A small assistant.", "reasoning_content": "They ask my identity."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4.", "reasoning_content": "Add the numbers."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome.", "reasoning_content": "Be polite."},
]


def masked_spans(template: ChatTemplate, messages: list[dict]) -> tuple[list[int], list[str]]:
    """(all ids, decoded text of each run of loss-masked tokens)."""
    segment_ids, mask = template.encode(template.layout(messages).segments)
    ids = [token for segment in segment_ids for token in segment]
    spans, current = [], []
    for token, trained in zip(ids, mask):
        if trained:
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    spans += [current] if current else []
    return ids, [template.tokenizer.decode(span, skip_special_tokens=False) for span in spans]


def rendered_ids(template: ChatTemplate, messages: list[dict]) -> list[int]:
    """The tokenizer's own rendering and tokenization: the independent reference for the whole sequence."""
    rendered = template.tokenizer.apply_chat_template(messages, tokenize=True, **template.template_kwargs)
    return list(rendered["input_ids"])


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(smollm2_dir, trust_remote_code=False), {"thinking": True})


@pytest.fixture(scope="module", params=[True, False], ids=["thinking", "instant"])
def kimi(request, tiny_kimi_dir) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(tiny_kimi_dir, trust_remote_code=False), {"thinking": request.param})


def test_smollm2_masks_exactly_the_assistant_turns(smollm2):
    ids, spans = masked_spans(smollm2, MULTI_TURN)
    assert ids == rendered_ids(smollm2, MULTI_TURN)
    # ChatML: each answer and its <|im_end|>; the newline after it is the template's, not the assistant's
    assert spans == ["A small assistant.<|im_end|>", "2 + 2 = 4.<|im_end|>", "You're welcome.<|im_end|>"]


def test_kimi_masks_follow_what_the_template_renders_and_the_last_turn_as_served(kimi):
    ids, spans = masked_spans(kimi, MULTI_TURN)
    # Kimi-K2.5 renders finished turns with an empty <think></think>: their reasoning is dropped. In thinking
    # mode the generation prompt ends with <think>, so </think> is the assistant's; in instant mode it is not.
    thinking = kimi.template_kwargs["thinking"]
    opener = "</think>" if thinking else ""
    answers = [m for m in MULTI_TURN if m["role"] == "assistant"]
    assert spans[:-1] == [f"{opener}{m['content']}<|im_end|>" for m in answers[:-1]]
    assert all(m["reasoning_content"] not in kimi.render(MULTI_TURN) for m in answers)
    # The last turn as the target served it: in thinking mode its reasoning, then </think> and the answer; the
    # tokenizer's own rendering of the prompt and of that text is the reference.
    served = f"{answers[-1]['reasoning_content'] if thinking else ''}{opener}{answers[-1]['content']}<|im_end|>"
    assert spans[-1] == served
    prompt = kimi.render(MULTI_TURN[:-1], generation_prompt=True)
    assert ids == kimi.tokenizer(prompt + served, add_special_tokens=False)["input_ids"]
    if not thinking:  # instant mode serves no reasoning: the whole conversation is the template's rendering
        assert ids == rendered_ids(kimi, MULTI_TURN)


def test_kimi_served_last_turn_keeps_the_reasoning_the_target_wrote(kimi):
    served = {"completion": "Be polite.</think>You're welcome.", "finished": True}
    messages = MULTI_TURN[:-1] + [MULTI_TURN[-1] | served]
    ids, spans = masked_spans(kimi, messages)
    prompt = kimi.render(messages[:-1], generation_prompt=True)
    # the last turn as served: the generation prompt, then everything the target wrote, then its end of turn
    assert kimi.tokenizer.decode(ids, skip_special_tokens=False) == prompt + served["completion"] + "<|im_end|>"
    assert spans[-1] == served["completion"] + "<|im_end|>"
    assert spans[:-1] == masked_spans(kimi, MULTI_TURN)[1][:-1]  # earlier turns: as the template renders them


def test_served_turn_cut_by_max_tokens_has_no_end_of_turn(smollm2):
    messages = [{"role": "user", "content": "Count."},
                {"role": "assistant", "content": "1 2 3", "completion": "1 2 3", "finished": False}]
    assert masked_spans(smollm2, messages)[1] == ["1 2 3"]


def test_prompt_ids_end_with_the_generation_prompt(smollm2, kimi):
    for template in (smollm2, kimi):
        layout = template.layout(MULTI_TURN)
        segment_ids, _ = template.encode(layout.segments)
        prompt = [t for ids in segment_ids[: layout.prompt_end] for t in ids]
        expected = template.render(MULTI_TURN[:-1], generation_prompt=True)
        assert template.tokenizer.decode(prompt, skip_special_tokens=False) == expected
        assert prompt == template.prompt_ids(MULTI_TURN[:-1])


def test_special_tokens_are_single_ids_and_the_end_of_turn_is_found(smollm2, kimi):
    assert (smollm2.end_of_turn, smollm2.end_of_turn_id) == ("<|im_end|>", 2)
    assert (kimi.end_of_turn, kimi.end_of_turn_id) == ("<|im_end|>", 163586)
    assert kimi.tokenizer.encode("<think>x</think>", add_special_tokens=False)[0] == 163606
    assert kimi.user_prefix.endswith("<|im_user|>user<|im_middle|>")


def test_reasoning_split_depends_on_whether_the_prompt_opened_it(smollm2, kimi):
    assert kimi.split_reasoning("hmm</think> Four.") == ("hmm", "Four.")
    expected_cut = ("still thinking", "") if kimi.opens_reasoning else ("", "still thinking")
    assert kimi.split_reasoning("still thinking") == expected_cut
    assert smollm2.split_reasoning("Four.") == ("", "Four.")


def test_template_rewriting_earlier_turns_is_refused(smollm2):
    class Rewriting:  # renders earlier answers differently once a later turn exists
        def __getattr__(self, name):
            return getattr(smollm2.tokenizer, name)

        def apply_chat_template(self, messages, **kwargs):
            text = smollm2.tokenizer.apply_chat_template(messages, **kwargs)
            return text.replace("A small", "One small") if len(messages) > 3 else text

    rewriting = ChatTemplate.__new__(ChatTemplate)
    rewriting.__dict__.update(smollm2.__dict__, tokenizer=Rewriting())
    with pytest.raises(InvalidConversation, match="template_inconsistent"):
        rewriting.layout(MULTI_TURN)
