"""The target's chat template turned into token ids with an assistant-only loss mask.

The mask is derived from the template's own renderings, never from a per-model pattern. For each assistant
turn the conversation is rendered up to the turn with the generation prompt (what the target is given) and
through the turn (what the template writes for it): the text between the two, cut after the template's
end-of-turn token, is what the assistant produced (content, the reasoning the template keeps, the
end-of-turn token); everything else (system, user and tool text, role headers, the generation prompt, the
newline some templates add after the end-of-turn token) is masked out. Every rendering must extend the
previous one. A template that drops the reasoning of earlier turns once later ones exist (Kimi-K2.5 keeps
the reasoning of the tool-call steps of the turn in progress, and drops it once a final answer follows)
is laid out again without the reasoning it drops; a template that rewrites earlier turns otherwise cannot
be laid out as one sequence, and such a conversation is skipped ("template_inconsistent"); so is one that
opens with an assistant turn ("assistant_first": templates render no prompt for it).

Tool calls: an assistant turn's tool-call section (found by rendering a probe call: the first added token
the template writes after the content) is the assistant's and trained; tool results are the template's
text between turns, never trained. A target whose template does not write tool calls skips conversations
that hold them ("tools_unsupported"); so does one whose template does not render the `tools` (SmolLM2's):
its prompts would lack the functions they ask about. Trained text is split by kind for the data report:
`reasoning` (through `</think>`), `answer` (content and end-of-turn token) and `tool_call` (the section and
the end-of-turn token after it).

The last assistant turn is laid out as it was served, whoever wrote it: its generation prompt (render of the
conversation before it), then what the target emits after it. When the target wrote it in this stage, that is its
raw completion (Kimi thinking mode: `reasoning</think>answer`) and the end-of-turn token if it emitted one; else
the turn as the template writes it after a generation prompt in the full rendering, with the turn's reasoning
put back before `</think>` where the template drops it (Kimi-K2.5's drops the reasoning of a finished answer,
which the target did write when it answered in thinking mode). Earlier turns follow the template (as the target
sees them at serving time later in the chat); `data.each_assistant_turn` lays each of them out as served in a
sample of its own.

Text is tokenized segment by segment (header, answer, ...) without added special tokens, so a mask boundary
is always a token boundary; the special tokens are checked to encode to single ids first.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3_pipeline.config_sections import TargetConfig
from eagle3_pipeline.data.conversations import InvalidConversation
from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.target import remote_tokenizer_class

REASONING_START, REASONING_END = "<think>", "</think>"  # Kimi's reasoning markers (also DeepSeek-R1's, Qwen3's)
PROBE_USER, PROBE_ANSWER = "Ping?", "Pong."
PROBE_CALL = {"id": "functions.probe:0", "type": "function", "function": {"name": "probe", "arguments": "{}"}}
PROBE_TOOL = {"type": "function", "function": {"name": "probe", "description": "Answers a ping.",
                                               "parameters": {"type": "object", "properties": {}}}}
KINDS = ("reasoning", "answer", "tool_call")  # what a trained token is, for the data report


class _TurnRewritten(Exception):
    """Rendering through turn `index` does not extend the layout of the turns before it."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


@dataclass(frozen=True)
class Segment:
    text: str
    kind: str | None = None  # one of KINDS when the assistant produced it (loss_mask 1), else None

    @property
    def trained(self) -> bool:
        return self.kind is not None


@dataclass(frozen=True)
class Layout:
    segments: list[Segment]
    prompt_end: int  # segments[:prompt_end] is the prompt of the last assistant turn (generation prompt included)


def load_tokenizer(model_dir: Path, trust_remote_code: bool):
    """The target's tokenizer. A remote-code tokenizer (Kimi's TikTokenTokenizer) is loaded through its own
    class: `AutoTokenizer` in recent transformers can fall back to a generic backend that splits <think>."""
    from transformers import AutoTokenizer
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    remote_class = remote_tokenizer_class(model_dir)
    if trust_remote_code and remote_class:
        return get_class_from_dynamic_module(remote_class, str(model_dir)).from_pretrained(str(model_dir))
    return AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)


def special_tokens(tokenizer) -> dict[str, int]:
    """Special token text -> id (the added tokens marked special, else the tokenizer's named specials)."""
    added = {token.content: i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return added or dict(zip(tokenizer.all_special_tokens, tokenizer.all_special_ids))


def check_special_tokens(tokenizer) -> None:
    """Every special token must encode to its own single id, or masks and templates silently break."""
    broken = [f"{text!r} -> {ids}" for text, token_id in special_tokens(tokenizer).items()
              if (ids := tokenizer.encode(text, add_special_tokens=False)) != [token_id]]
    if broken:
        raise StageError(
            f"the target tokenizer splits special tokens ({', '.join(broken[:4])}{', ...' * (len(broken) > 4)}); "
            "for a remote-code tokenizer set target.trust_remote_code: true"
        )


class ChatTemplate:
    """Renders conversations with the target's template and lays them out as masked segments."""

    def __init__(self, tokenizer, template_kwargs: dict[str, Any]):
        check_special_tokens(tokenizer)
        self.tokenizer = tokenizer
        self.template_kwargs = template_kwargs
        self.end_of_turn = self._probe_end_of_turn()
        self.end_of_turn_id = special_tokens(tokenizer)[self.end_of_turn]
        user = self.render([{"role": "user", "content": PROBE_USER}])
        self.user_prefix = user[: user.index(PROBE_USER)]  # magpie: the target continues from here
        # Kimi thinking mode: the generation prompt opens the reasoning, so a completion starts inside it
        self.opens_reasoning = self.render([{"role": "user", "content": PROBE_USER}], True).endswith(REASONING_START)
        added = {token.content for token in tokenizer.added_tokens_decoder.values()}  # Kimi's </think> is not special
        self.reasoning_end = REASONING_END if REASONING_END in added else None
        self.tool_calls_start = self._probe_tool_calls_start()
        # a template that ignores `tools` would serve prompts without the functions they ask about
        probe = [{"role": "user", "content": PROBE_USER}]
        self.renders_tools = self.render(probe, tools=[PROBE_TOOL]) != self.render(probe)

    @classmethod
    def for_target(cls, target: TargetConfig, model_dir: Path, thinking: bool) -> ChatTemplate:
        template_kwargs = {"thinking": thinking, **target.chat_template_kwargs}
        return cls(load_tokenizer(model_dir, target.trust_remote_code), template_kwargs)

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> str:
        from jinja2 import TemplateError

        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
            )
        except TemplateError:  # the template's own check failed (e.g. roles must alternate)
            raise InvalidConversation("template_error") from None

    def _probe_end_of_turn(self) -> str:
        """The first special token the template writes after an assistant turn's content."""
        found = self._first_token_after_answer({}, special_tokens(self.tokenizer))
        if found is None:
            raise StageError("the chat template writes no special token after an assistant turn")
        return found

    def _probe_tool_calls_start(self) -> str | None:
        """The added token that opens the template's tool-call section (Kimi's is not marked special); None
        when the template writes no tool calls."""
        added = [token.content for token in self.tokenizer.added_tokens_decoder.values()]
        try:
            found = self._first_token_after_answer({"tool_calls": [PROBE_CALL]}, added)
        except InvalidConversation:  # the template refuses tool calls
            return None
        return None if found == self.end_of_turn else found

    def _first_token_after_answer(self, answer_fields: dict[str, Any], tokens: Iterable[str]) -> str | None:
        """The first of `tokens` the template writes after a probe answer with `answer_fields`."""
        answer = {"role": "assistant", "content": PROBE_ANSWER, **answer_fields}
        turn = self.render([{"role": "user", "content": PROBE_USER}, answer])
        after_answer = turn[turn.rindex(PROBE_ANSWER) + len(PROBE_ANSWER):]
        tokens = sorted(tokens, key=len, reverse=True)
        found = re.search("|".join(map(re.escape, tokens)), after_answer) if tokens else None
        return found.group() if found else None

    # -------------------------------------------------------------------------------------------- layout
    def layout(self, messages: list[dict[str, Any]], generation_prompt: bool = False,
               tools: list[dict[str, Any]] | None = None) -> Layout:
        """Segments of `messages` (ending with an assistant turn, or with `generation_prompt` after any turn)."""
        if not messages or messages[0]["role"] == "assistant":  # no prompt to render before the answer
            raise InvalidConversation("assistant_first")
        if (tools and not self.renders_tools) or (self.tool_calls_start is None
                                                  and any(m.get("tool_calls") for m in messages)):
            raise InvalidConversation("tools_unsupported")
        while True:
            try:
                return self._layout(messages, generation_prompt, tools)
            except _TurnRewritten as err:  # drop the reasoning the template drops once turn `index` exists
                earlier = messages[: err.index]
                if not any("reasoning_content" in m for m in earlier):
                    raise InvalidConversation("template_inconsistent") from None
                messages = [_without_reasoning(m) for m in earlier] + messages[err.index:]

    def _layout(self, messages: list[dict[str, Any]], generation_prompt: bool,
                tools: list[dict[str, Any]] | None) -> Layout:
        segments: list[Segment] = []
        laid_out = ""  # the text the segments spell so far; every rendering must extend it
        answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for index in answers + ([len(messages)] if generation_prompt else []):
            header = self.render(messages[:index], generation_prompt=True, tools=tools)
            segments.append(Segment(_extension(laid_out, header, index)))
            prompt_end = len(segments)
            if index == len(messages):
                break
            served = index == answers[-1] and not generation_prompt
            answer, trailing = self._answer(messages, index, header, tools, served)
            segments += self._by_kind(answer, header) + [Segment(trailing)]
            laid_out = header + answer + trailing
        return Layout(segments, prompt_end)

    def _answer(self, messages: list[dict[str, Any]], index: int, header: str, tools: list[dict[str, Any]] | None,
                served: bool) -> tuple[str, str]:
        """The assistant-produced text of turn `index` (after `header`), and the template's text after it."""
        message = messages[index]
        if served and "completion" in message:
            return message["completion"] + (self.end_of_turn if message["finished"] else ""), ""
        rendered = self.render(messages[: index + 1], tools=tools)
        if served and not rendered.startswith(header):  # the template drops reasoning the served prompt keeps
            generation_prompt = _extension(self.render(messages[:index], tools=tools), header, index)
            if generation_prompt not in rendered:
                raise InvalidConversation("template_inconsistent")
            rendered = header + rendered[rendered.rindex(generation_prompt) + len(generation_prompt):]
        turn = _extension(header, rendered, index)
        if served and self.opens_reasoning_after(header) and turn.startswith(REASONING_END):
            turn = message.get("reasoning_content", "") + turn  # as the target wrote it; the template dropped it
        content = message["content"].strip()
        after_content = turn.rfind(content) + len(content) if content and content in turn else 0
        end = turn.find(self.end_of_turn, after_content)
        cut = end + len(self.end_of_turn) if end >= 0 else len(turn)
        return turn[:cut], turn[cut:]

    def opens_reasoning_after(self, header: str) -> bool:
        """The target's answer after `header` starts inside its reasoning (a thinking-mode generation prompt)."""
        return self.reasoning_end is not None and header.endswith(REASONING_START)

    def _by_kind(self, answer: str, header: str) -> list[Segment]:
        """`answer` as reasoning (through `</think>`; all of it when the header opened the reasoning and it
        never closed), answer and tool-call segments. Cuts fall at added tokens, so at token boundaries."""
        in_reasoning = self.opens_reasoning_after(header)
        closed = answer.find(self.reasoning_end) if self.reasoning_end else -1
        reasoning_cut = closed + len(self.reasoning_end) if closed >= 0 else len(answer) if in_reasoning else 0
        calls = answer.find(self.tool_calls_start, reasoning_cut) if self.tool_calls_start else -1
        calls = calls if calls >= 0 else len(answer)
        parts = zip(KINDS, (answer[:reasoning_cut], answer[reasoning_cut:calls], answer[calls:]))
        return [Segment(text, kind) for kind, text in parts if text]

    # ------------------------------------------------------------------------------------------ tokens
    def encode(self, segments: list[Segment]) -> tuple[list[list[int]], list[int]]:
        """Token ids per segment, and the flat loss mask."""
        ids = self.tokenizer([s.text for s in segments], add_special_tokens=False)["input_ids"]
        mask = [int(s.trained) for s, segment_ids in zip(segments, ids) for _ in segment_ids]
        return ids, mask

    def user_prefix_ids(self) -> list[int]:
        return self.encode([Segment(self.user_prefix)])[0][0]

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """What the target is given to write the next assistant turn after `messages`."""
        ids, _ = self.encode(self.layout(messages, generation_prompt=True, tools=tools).segments)
        return [token for segment in ids for token in segment]

    def tool_call_section(self, text: str) -> str:
        """The tool-call section in an assistant's `text`, up to its end-of-turn token ('' when it has none)."""
        start = text.find(self.tool_calls_start) if self.tool_calls_start else -1
        return text[start:].split(self.end_of_turn)[0] if start >= 0 else ""

    def split_reasoning(self, completion: str) -> tuple[str, str]:
        """(reasoning, answer) of a raw completion. Without `</think>` it is all reasoning when the generation
        prompt opened the reasoning (a completion cut short while thinking), else all answer."""
        reasoning, sep, answer = completion.partition(REASONING_END)
        if sep:
            return reasoning.removeprefix(REASONING_START).strip(), answer.strip()
        return (completion.strip(), "") if self.opens_reasoning else ("", completion.strip())


def _extension(prefix: str, text: str, index: int) -> str:
    if not text.startswith(prefix):
        raise _TurnRewritten(index)
    return text[len(prefix):]


def _without_reasoning(message: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key != "reasoning_content"}
