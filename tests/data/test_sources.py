"""Benchmark sources from their wheels: every test problem once; MT-Bench's two turns as 01 regenerates and serves them."""

from __future__ import annotations

import gzip
import json
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle3_pipeline.config_sections import DataConfig, SourceConfig
from eagle3_pipeline.data.chat_template import ChatTemplate, load_tokenizer
from eagle3_pipeline.data.conversations import Skips
from eagle3_pipeline.data.generate import Rewrite
from eagle3_pipeline.data.samples import to_rows
from eagle3_pipeline.data.sources import BENCHMARKS, load_conversations

DATA = DataConfig(sources=[SourceConfig(kind="mtbench")], max_seq_len=2048)


@pytest.fixture(scope="module")
def smollm2(smollm2_dir) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(smollm2_dir, trust_remote_code=False), {"thinking": True})


def wheel_records(kind: str) -> list[dict]:
    """The benchmark's file read independently of sources.py (plain json, gzip by suffix)."""
    path = Path(metadata.distribution(BENCHMARKS[kind].package).locate_file(BENCHMARKS[kind].file))
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_mtbench_reads_the_wheels_80_questions_as_two_user_turns():
    skips = Skips()
    conversations = load_conversations(SourceConfig(kind="mtbench"), "mtbench", skips)
    questions = wheel_records("mtbench")
    assert len(questions) == len(conversations) == 80 and not skips.counts
    assert [c.id for c in conversations] == [f"mtbench-{i}" for i in range(80)]
    for conversation, question in zip(conversations, questions):
        assert conversation.messages == [{"role": "user", "content": turn} for turn in question["turns"]]


@pytest.mark.parametrize("kind, count, first_words, field", [
    ("humaneval", 164, "Complete the following Python function", lambda r: r["prompt"]),
    ("gsm8k", 1319, "Janet\u2019s ducks lay 16 eggs", lambda r: r["question"]),
    ("math500", 500, "Convert the point $(0,3)$", lambda r: r["doc"]["problem"]),
])
def test_single_turn_benchmarks_hold_every_test_problem_once(kind, count, first_words, field):
    conversations = load_conversations(SourceConfig(kind=kind), kind, Skips())
    records = wheel_records(kind)
    assert len(conversations) == len(records) == count
    assert conversations[0].messages[0]["content"].startswith(first_words)
    for conversation, record in zip(conversations, records):
        assert len(conversation.messages) == 1 and field(record) in conversation.messages[0]["content"]
    assert len({c.messages[0]["content"] for c in conversations}) == count


def answered(conversation, template: ChatTemplate, answers: list[str]):
    """The conversation as regeneration leaves it: the target's answer after each user turn, in order."""
    rewrite = Rewrite(conversation)
    for answer in answers:
        assert rewrite.needs_answer()
        rewrite.add_answer(template, answer, finished=True)  # vLLM leaves the stop token out of the text
    assert not rewrite.needs_answer()
    return conversation.__class__(conversation.id, conversation.source, rewrite.record()["messages"])


def test_second_turn_follows_the_targets_first_answer_and_both_are_served(smollm2):
    conversation = load_conversations(SourceConfig(kind="mtbench", limit=1), "mtbench", Skips())[0]
    first, second = (m["content"] for m in conversation.messages)
    messages = answered(conversation, smollm2, ["FIRST ANSWER", "SECOND ANSWER"]).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]

    rows = to_rows([answered(conversation, smollm2, ["FIRST ANSWER", "SECOND ANSWER"])], smollm2, DATA,
                   with_prompt=True, skips=Skips(), split="eval")
    assert [row["id"] for row in rows] == ["mtbench-0-turn1", "mtbench-0-turn2"]
    decode = smollm2.tokenizer.decode
    for row, answer in zip(rows, ("FIRST ANSWER", "SECOND ANSWER")):
        prompt_len = len(row["prompt_ids"])
        assert list(row["input_ids"][:prompt_len]) == list(row["prompt_ids"])
        assert decode(row["prompt_ids"]).endswith("<|im_start|>assistant\n")
        # only the served turn is in the loss mask: the first answer is context of the second prompt
        trained = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert decode(trained) == answer + "<|im_end|>" and not any(row["loss_mask"][:prompt_len])
    assert first in decode(rows[0]["prompt_ids"]) and second not in decode(rows[0]["prompt_ids"])
    second_prompt = decode(rows[1]["prompt_ids"])
    assert second_prompt.index(first) < second_prompt.index("FIRST ANSWER") < second_prompt.index(second)


def test_without_regeneration_the_first_question_stays_a_prompt_for_06(smollm2):
    conversation = load_conversations(SourceConfig(kind="mtbench", limit=1), "mtbench", Skips())[0]
    skips = Skips()
    rows = to_rows([conversation], smollm2, DATA, with_prompt=True, skips=skips, split="eval")
    assert len(rows) == 1 and not skips.counts
    row = rows[0]
    assert list(row["input_ids"]) == list(row["prompt_ids"]) == smollm2.prompt_ids(conversation.messages[:1])
    assert not any(row["loss_mask"])
    # a training conversation without an answer teaches nothing: still skipped
    assert to_rows([conversation], smollm2, DATA, with_prompt=False, skips=skips, split="train") == []
    assert skips.counts == {"no_assistant_turn": 1}


class RecordingEngine:
    """Stands in for vLLM's LLM in generate.py: answers every prompt with a fixed text, records the params."""

    def __init__(self):
        self.temperatures: list[float] = []

    def generate(self, prompts, params, use_tqdm):
        self.temperatures += [p.temperature for p in params]
        return [SimpleNamespace(outputs=[SimpleNamespace(text="An answer.", finish_reason="stop")]) for _ in prompts]


def test_eval_answers_are_regenerated_at_the_eval_temperature(smollm2, demo_config):
    from eagle3_pipeline.data.generate import _generate_chunk

    train, eval_ = load_conversations(SourceConfig(kind="mtbench", limit=2), "mtbench", Skips())
    config = demo_config.model_copy(update={"data": demo_config.data.model_copy(update={
        "regenerate": demo_config.data.regenerate.model_copy(update={"temperature": 0.7, "eval_temperature": 0.0})})})
    engine = RecordingEngine()
    records = _generate_chunk(engine, smollm2, [train, eval_], config, eval_ids={eval_.id})
    # two rounds (one answer per user turn), the train conversation's request first in each
    assert engine.temperatures == [0.7, 0.0, 0.7, 0.0]
    assert [m["role"] for m in records[1]["messages"]] == ["user", "assistant", "user", "assistant"]
