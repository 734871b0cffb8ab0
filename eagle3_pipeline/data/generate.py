"""Turns the target writes itself through vLLM: magpie user turns and regenerated answers.

Magpie: the target is given the chat template's user prefix (system turn, user header) and writes a user
turn, then answers it. Regeneration: each assistant turn is replaced by the target's own answer to the
conversation so far (earlier answers already replaced), a user turn followed by another user turn gets an
answer between them (MT-Bench's two questions), and a conversation ending with a user turn gets an answer;
batches go round by round, one turn per conversation per round.

Agentic conversations are regenerated turn by turn too, tool-calling turns included; the recorded tool
results stay, as the target cannot know them. A regenerated turn that writes exactly the recorded turn's
tool-call section (as the template renders it: ids, names and arguments to the character) keeps the
recorded calls, so the recorded results answer them, and the conversation goes on. One that calls other
tools, calls none where the recording called some, or calls some where the recording answered, ends the
conversation there: it is kept through that turn (trained as the target wrote it) and the recorded turns
after it, which answer other calls, are dropped.

The work is split into chunks of `data.regenerate.chunk_size` conversations in a fixed order. Each finished
chunk is written atomically to `generated/chunk-NNNNN.jsonl`; a rerun after a kill reads the finished chunks
and generates only the missing ones, so nothing is lost or generated twice. Per-request seeds derive from
the sample id, so a resumed run samples what an uninterrupted one would have.
"""

from __future__ import annotations

import dataclasses
import json
import time
import zlib
from pathlib import Path
from typing import Any

from tqdm import tqdm

from eagle3_pipeline.acceptance import read_counters
from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.data.chat_template import ChatTemplate
from eagle3_pipeline.data.conversations import Conversation, InvalidConversation, Skips, image_sources
from eagle3_pipeline.data.stats import GenerationFigures
from eagle3_pipeline.data.vision import Vision, request
from eagle3_pipeline.engine import speculative_config, start_engine
from eagle3_pipeline.stage_io import Stage, StageError

CHUNK_DIR = "generated"


def generate_turns(stage: Stage, config: RunConfig, template: ChatTemplate, model_dir: Path,
                   conversations: list[Conversation], skips: Skips, eval_ids: set[str],
                   vision: Vision | None = None) -> tuple[list[Conversation], GenerationFigures]:
    """`conversations` with every turn the target writes written (the answers of `eval_ids` at
    `data.regenerate.eval_temperature`), and the figures of the generation done here; those that failed are
    moved to `skips`. Conversations with images need the target's `vision` (their prompts carry the images).
    With `data.regenerate.speculative` the target's engine drafts with that draft."""
    regenerate = config.data.regenerate
    todo = [c for c in conversations if c.magpie is not None or regenerate.enabled]
    chunk_size = stage.layout_knob("data.regenerate.chunk_size")
    chunks = [todo[i: i + chunk_size] for i in range(0, len(todo), chunk_size)]
    paths = [stage.path(f"{CHUNK_DIR}/chunk-{k:05d}.jsonl") for k in range(len(chunks))]
    missing = [k for k, path in enumerate(paths) if not path.exists()]
    if todo:
        done = len(chunks) - len(missing)
        print(f"generation: {len(todo)} conversations in {len(chunks)} chunks, {done} already done")
    figures = GenerationFigures()
    if missing:
        speculative = regenerate.speculative
        k = speculative.num_speculative_tokens if speculative else 0
        settings = {"speculative_config": speculative_config(Path(speculative.draft), k),
                    "disable_log_stats": False} if speculative else {}  # its spec-decode counters
        llm = start_engine(config.target, model_dir, text_only=vision is None, **settings)
        before = read_counters(llm.get_metrics(), k) if k else None
        for chunk in tqdm(missing, desc="generated chunks", unit="chunk"):
            records = _generate_chunk(llm, template, chunks[chunk], config, eval_ids, vision, figures)
            with stage.atomic(f"{CHUNK_DIR}/{paths[chunk].name}") as tmp:
                tmp.write_text("".join(json.dumps(record) + "\n" for record in records))
        if k:
            figures.acceptance = read_counters(llm.get_metrics(), k) - before
        del llm  # frees the engine's memory before tokenization

    written = {}
    for chunk, path in zip(chunks, paths):
        written.update(_read_chunk(path, chunk))
    return _merge(conversations, written, skips), figures


def _merge(conversations: list[Conversation], written: dict[str, dict[str, Any]], skips: Skips) -> list[Conversation]:
    """The conversations with their generated turns; the ones generation gave up on go to `skips`."""
    kept = []
    for conversation in conversations:
        record = written.get(conversation.id)
        if record is None:
            kept.append(conversation)
        elif "skip" in record:
            skips.add(record["skip"], conversation.id)
        else:
            kept.append(dataclasses.replace(conversation, messages=record["messages"], magpie=None))
    return kept


def _read_chunk(path: Path, chunk: list[Conversation]) -> dict[str, dict[str, Any]]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    if [r["id"] for r in records] != [c.id for c in chunk]:
        raise StageError(f"{path} holds other samples than this run would generate: rerun with --force")
    return {record["id"]: record for record in records}


class Rewrite:
    """One conversation rebuilt turn by turn: its user, system and tool turns kept, its answers the target's."""

    def __init__(self, conversation: Conversation):
        self.conversation = conversation
        self.pending = list(conversation.messages)  # original turns not yet copied or replaced
        self.messages: list[dict[str, Any]] = []
        self.replaced: dict[str, Any] | None = None  # the recorded answer the one being generated replaces
        self.skip: str | None = None

    def needs_answer(self) -> bool:
        """Copy the turns before the next answer; True when the target has an answer to write now: in place of
        a recorded answer, between two user turns (MT-Bench's second question follows the first answer), or
        after the last turn."""
        self.replaced = None
        while self.pending and self.pending[0]["role"] != "assistant":
            self.messages.append(self.pending.pop(0))
            if self.messages[-1]["role"] == "user" and self.pending and self.pending[0]["role"] == "user":
                return True
        self.replaced = self.pending.pop(0) if self.pending else None
        return self.replaced is not None or (bool(self.messages) and self.messages[-1]["role"] != "assistant")

    def add_answer(self, template: ChatTemplate, completion: str, finished: bool) -> None:
        """The target's answer (`finished`: it stopped on its end-of-turn token); a tool-call section other
        than the recorded one ends the conversation here."""
        reasoning, content = template.split_reasoning(completion)
        calls = template.tool_call_section(content)
        recorded = self.replaced.get("tool_calls") if self.replaced else None
        answer = {"role": "assistant", "content": content, "completion": completion, "finished": finished}
        if calls and recorded and calls == template.tool_call_section(template.render([self.replaced])):
            answer |= {"content": content[: content.index(calls)].strip(), "tool_calls": recorded}
        elif calls or recorded:
            self.pending = []  # the recorded results answer other calls than these (or none)
        self.messages.append(answer | ({"reasoning_content": reasoning} if reasoning else {}))
        self.skip = None if completion.strip() else "empty_generation"

    def record(self) -> dict[str, Any]:
        if self.skip:
            return {"id": self.conversation.id, "skip": self.skip}
        return {"id": self.conversation.id, "messages": self.messages}


def _generate_chunk(llm, template: ChatTemplate, chunk: list[Conversation], config: RunConfig,
                    eval_ids: set[str], vision: Vision | None = None, figures: GenerationFigures | None = None
                    ) -> list[dict]:
    rewrites = [Rewrite(c) for c in chunk]
    user_prefix = template.user_prefix_ids()
    magpie = [(r, user_prefix, r.conversation.magpie) for r in rewrites if r.conversation.magpie is not None]
    for rewrite, output in _complete(llm, config, template, magpie, "user", vision, figures):
        user_turn = output.text.strip()
        rewrite.messages.append({"role": "user", "content": user_turn})
        rewrite.skip = None if user_turn else "empty_generation"
    regenerate = config.data.regenerate
    answers = {False: regenerate, True: regenerate.model_copy(update={"temperature": regenerate.eval_temperature})}
    turn = 0
    while waiting := [r for r in rewrites if not r.skip and r.needs_answer()]:
        requests = [(r, ids, answers[r.conversation.id in eval_ids]) for r in waiting
                    if (ids := _prompt_ids(template, r)) is not None]
        for rewrite, output in _complete(llm, config, template, requests, f"answer {turn}", vision,
                                          figures):
            rewrite.add_answer(template, output.text, finished=output.finish_reason == "stop")
        turn += 1
    return [r.record() for r in rewrites]


def _prompt_ids(template: ChatTemplate, rewrite: Rewrite) -> list[int] | None:
    try:
        return template.prompt_ids(rewrite.messages, rewrite.conversation.tools)
    except InvalidConversation as err:  # e.g. a template that rejects this order of roles
        rewrite.skip = err.reason
        return None


def _complete(llm, config: RunConfig, template: ChatTemplate, requests: list[tuple[Rewrite, list[int], Any]],
              what: str, vision: Vision | None, figures: GenerationFigures | None = None) -> list[tuple[Rewrite, Any]]:
    """(rewrite, completion) for each request that fits the engine; the others are marked overlong_prompt.

    A request is (rewrite, prompt ids as the template writes them, settings with temperature and max_tokens);
    the images of the conversation so far go with it, and its length is the prompt's once vLLM expands them."""
    from vllm import SamplingParams

    max_model_len = config.target.engine.max_model_len
    fitting = []
    for rewrite, prompt_ids, settings in requests:
        images = [rewrite.conversation.images[source] for source in image_sources(rewrite.messages)]
        try:
            length = sum(vision.repeats(prompt_ids, images)) if images else len(prompt_ids)
        except InvalidConversation as err:
            rewrite.skip = err.reason
            continue
        room = min(settings.max_tokens, max_model_len - length)
        if room < 1:
            rewrite.skip = "overlong_prompt"
            continue
        seed = zlib.crc32(f"{config.data.seed}/{rewrite.conversation.id}/{what}".encode())
        params = SamplingParams(temperature=settings.temperature, max_tokens=room, seed=seed,
                                stop_token_ids=[template.end_of_turn_id], skip_special_tokens=False)
        fitting.append((rewrite, request(prompt_ids, images, vision, expanded=False), params))
    if not fitting:
        return []
    started = time.perf_counter()
    outputs = llm.generate([f[1] for f in fitting], [f[2] for f in fitting], use_tqdm=True)
    if figures is not None:
        figures.add(outputs, time.perf_counter() - started)
    return [(rewrite, output.outputs[0]) for (rewrite, _, _), output in zip(fitting, outputs)]
