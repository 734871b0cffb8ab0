"""The learned tiny Kimi (`eagle3_pipeline.stand_ins.learned_kimi`): its chats as served, its refusal to train for
hours on a CPU, and a brief build on the CPU that learns and keeps the random stand-in's checkpoint exactly (names,
shapes, dtypes, the vision tower), so vLLM and transformers load it as they load tiny-kimi-k25."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.stand_ins import ensure_stand_in, learned_kimi
from eagle3_pipeline.stand_ins.tiny_kimi import SHARD_NAMES


def test_worked_chats_are_the_wheels_answers_as_reasoning_then_a_short_answer():
    chats = learned_kimi.worked_chats()
    assert len(chats) == 1319 + 164
    first = chats[0]
    assert first.user.startswith("Janet’s ducks lay 16 eggs per day.") and "\\boxed{}" in first.user
    assert first.reasoning.startswith("Janet sells 16 - 3 - 4 = 9 duck eggs a day.") and "<<" not in first.reasoning
    assert first.answer == "The answer is $\\boxed{18}$."
    assert chats[-1].answer.startswith("```python\n") and "def " in chats[-1].answer


def test_a_chat_is_laid_out_as_served_with_only_the_answer_learnt():
    folder = ensure_stand_in("tiny-kimi-k25")
    chat = learned_kimi.Chat("What is 2 + 3?", "Two plus three is five.", "5")
    [(ids, prompt)] = learned_kimi.tokenized_chats(folder, [chat])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.decode(ids[:prompt]).endswith("<|im_assistant|>assistant<|im_middle|><think>")
    assert tokenizer.decode(ids[prompt:]) == "Two plus three is five.</think>5<|im_end|>"
    _, attention, labels = learned_kimi.padded([(ids, prompt), (ids[:prompt + 2], prompt)])
    assert (labels[0] != -100).sum() == len(ids) - prompt and (labels[1] != -100).sum() == 2
    assert attention[1].sum() == prompt + 2


def test_the_full_build_refuses_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(StageError, match="trains its text model on a GPU"):
        learned_kimi.build(tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_brief_build_learns_and_keeps_the_checkpoint_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(learned_kimi, "TOKENS_PER_BATCH", 512)
    monkeypatch.setattr(learned_kimi, "GREEDY_TOKENS", 2)
    monkeypatch.setattr(learned_kimi, "PEAK_LR", 1e-2)
    monkeypatch.setattr(learned_kimi, "WARMUP", 1)
    learned_kimi.build(tmp_path, steps=6, limit=40)

    random_folder = ensure_stand_in("tiny-kimi-k25")
    for shard in SHARD_NAMES:
        learned, random = load_file(str(tmp_path / shard)), load_file(str(random_folder / shard))
        assert {n: (t.shape, t.dtype) for n, t in learned.items()} == {n: (t.shape, t.dtype) for n, t in random.items()}
        for name, tensor in learned.items():
            if name.startswith("vision_tower.") or name.startswith("mm_projector."):
                assert torch.equal(tensor, random[name]), name
        if shard == SHARD_NAMES[1]:  # the decoder layers: trained
            assert not torch.equal(learned["language_model.model.layers.0.self_attn.o_proj.weight"],
                                   random["language_model.model.layers.0.self_attn.o_proj.weight"])

    report = json.loads((tmp_path / "learned.json").read_text())
    assert report["steps"] == 6 and report["held_out_chats"] == 2 and len(report["greedy"]) == 2
    held_out = learned_kimi.tokenized_chats(random_folder, learned_kimi.worked_chats()[:40])[::learned_kimi.HELD_OUT_EVERY]
    before = learned_kimi.evaluate(learned_kimi.text_model(random_folder, "cpu"), held_out, "cpu")
    after = learned_kimi.evaluate(learned_kimi.text_model(tmp_path, "cpu"), held_out, "cpu")  # as written, in bf16
    print(f"held-out loss: random {before['eval_loss']:.3f}, after 6 steps {report['eval_loss']:.3f} "
          f"(re-read from the shards {after['eval_loss']:.3f})")
    assert after["eval_loss"] < before["eval_loss"] - 1.0
    assert abs(after["eval_loss"] - report["eval_loss"]) < 0.1  # the shards hold the model that was evaluated
