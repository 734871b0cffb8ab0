"""Conversations in one shape whatever schema they came in, and the bookkeeping of skipped records.

A message is a dict `{"role": "system"|"user"|"assistant"|"tool", "content": str}`; the content of a turn that
is not the assistant's may instead be a list of parts holding images, `{"type": "text", "text": str}` and
`{"type": "image", "image": SOURCE}` (SOURCE a local path or a data URL, from a record's `image_url` part, its
`image` part or key; the target's template writes its placeholder for each). An assistant message may
also carry `reasoning_content` (OpenAI-style reasoning, as Kimi's API returns it; records may name it
`reasoning`, `thinking` or `thinking_content`, or write it inline: an answer `<think>R</think>A`, or `R</think>A`
when the opener was dropped upstream, becomes reasoning R and content A), `tool_calls` (OpenAI's
`[{"id", "type": "function", "function": {"name", "arguments"}}]`; its content may then be empty) and, when
the target wrote it in this stage, `completion` (its raw output text) and `finished` (it ended with its
end-of-turn token). A tool message carries `tool_call_id` (and `name` when the record gives one); its
content may be empty. A conversation's `tools` are OpenAI function declarations, passed to the template.

ShareGPT tool records (`function_call` turns holding `{"name", "arguments"}` or a list of them,
`observation` turns holding the results, `tools` a list or a JSON string of bare function schemas) become
the same shape. They carry no call ids, so ids are written in Kimi's form `functions.NAME:IDX` (IDX counts
the calls of the conversation), and each observation answers the oldest call not yet answered.
kimi-mtp-dataset records (schema `kimi_mtp`: ShareGPT turns as Kimi-K2.5 wrote them) keep what the model
wrote inline: an assistant `value` opens with its reasoning in `<think>...</think>` and may end in Kimi's
tool-call section (`<|tool_calls_section_begin|>`, one `<|tool_call_begin|>ID<|tool_call_argument_begin|>ARGS
<|tool_call_end|>` per call, ids `functions.NAME:IDX`); a user turn's `value` may be a JSON string of OpenAI
content parts holding images. They become `reasoning_content`, `tool_calls` and image parts, which the
target's template lays out again; each tool turn (`from: tool` or `observation`) answers the oldest call not yet
answered. In any schema, a user turn's `<|image|>` placeholders take the record's images in order (`images`, a
list of paths or data URLs, or `image`); a record with fewer images than placeholders is skipped
(`image_missing`).
A record that cannot become a valid conversation raises `InvalidConversation` with a short reason; the
stage counts reasons instead of failing on them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from eagle3_pipeline.config_sections import SourceConfig

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "observation": "tool"}
KIMI_TOOL_CALLS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
KIMI_TOOL_CALL = ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
IMAGE_PARTS = {"image", "image_url"}  # content part types and keys holding an image
IMAGE_PLACEHOLDER = "<|image|>"  # where a text-only user turn shows one of the record's images
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking", "thinking_content")  # the names records use
REASONING_START, REASONING_END = "<think>", "</think>"  # reasoning written inline in an answer
FIRST_IDS_KEPT = 5  # example ids recorded per skip reason


class InvalidConversation(Exception):
    """A record that is skipped; `reason` is one short snake_case word group, counted in stats.json."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Conversation:
    id: str  # `<source>-<index in source>`: stable across runs, unique across splits
    source: str
    messages: list[dict[str, Any]]
    magpie: SourceConfig | None = None  # set when the target still has to write the user turn
    tools: list[dict[str, Any]] | None = None  # function declarations the conversation may call
    images: dict[str, bytes] = field(default_factory=dict)  # image source (path or data URL) -> file bytes

    @property
    def prompt_only(self) -> bool:
        """No assistant turn yet (a benchmark's prompt, before regeneration answers it)."""
        return not any(m["role"] == "assistant" for m in self.messages)


@dataclass
class Skips:
    """Skipped records per reason, with the first few ids of each (for stats.json and error messages)."""

    counts: Counter = field(default_factory=Counter)
    first_ids: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, sample_id: str) -> None:
        self.counts[reason] += 1
        examples = self.first_ids.setdefault(reason, [])
        if len(examples) < FIRST_IDS_KEPT:
            examples.append(sample_id)

    def as_dict(self) -> dict[str, dict[str, Any]]:
        return {reason: {"count": n, "first_ids": self.first_ids[reason]} for reason, n in sorted(self.counts.items())}

    def summary(self) -> str:
        counts = sorted(self.counts.items())
        return ", ".join(f"{reason} {n} (first: {self.first_ids[reason][0]})" for reason, n in counts)


def to_messages(record: Any, schema: str) -> list[dict[str, Any]]:
    """The messages of one record in ShareGPT (`conversations`: from/value), OpenAI (`messages`: role/content) or
    kimi-mtp-dataset's ShareGPT with Kimi's inline markers (`kimi_mtp`)."""
    if not isinstance(record, dict):  # also a JSON line that did not parse (the reader yields None)
        raise InvalidConversation("malformed_json")
    if schema == "auto":
        schema = "messages" if "messages" in record else "sharegpt"
    turns = record.get("messages" if schema == "messages" else "conversations")
    if not isinstance(turns, list) or not turns:
        raise InvalidConversation("no_messages")
    if schema == "messages":
        messages = [_message(turn, "role", "content", {role: role for role in ROLES}) for turn in turns]
    elif schema == "kimi_mtp":
        messages = _answer_calls([_kimi_mtp_message(turn) for turn in turns])
    else:
        messages = _answer_calls([_sharegpt_message(turn) for turn in turns])
    return _placed_images(messages, record)


def to_tools(record: Any) -> list[dict[str, Any]] | None:
    """The record's `tools` as OpenAI function declarations (a JSON string is parsed, bare schemas wrapped)."""
    tools = record.get("tools") if isinstance(record, dict) else None
    if isinstance(tools, str):
        tools = _parse_json(tools, "malformed_tools") if tools.strip() else None
    if not tools:
        return None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidConversation("malformed_tools")
    return [tool if "type" in tool else {"type": "function", "function": tool} for tool in tools]


def _message(turn: Any, role_key: str, content_key: str, roles: dict[str, str]) -> dict[str, Any]:
    role = _role(turn, role_key, roles)
    tool_calls = [_tool_call(call) for call in turn.get("tool_calls") or []] if role == "assistant" else []
    empty_allowed = role == "tool" or bool(tool_calls)
    content = turn.get(content_key)
    if role != "assistant" and isinstance(content, list) and any(_is_image(part) for part in content):
        message = {"role": role, "content": [_part(part) for part in content]}
    else:
        message = {"role": role, "content": _text(content, empty_allowed)}
    if role == "assistant":
        message |= _reasoning(turn, message["content"])
    if tool_calls:
        message["tool_calls"] = tool_calls
    if role == "tool":
        message |= {key: turn[key] for key in ("tool_call_id", "name") if isinstance(turn.get(key), str)}
    return message


def _reasoning(turn: dict[str, Any], content: str) -> dict[str, str]:
    """An answer's content without inline reasoning, and its reasoning (`reasoning_content`): the first reasoning
    field the turn fills, else what the content writes before `</think>` (with or without its `<think>`)."""
    reasoning, closed, answer = content.partition(REASONING_END)
    reasoning, found = (reasoning.lstrip().removeprefix(REASONING_START), {"content": answer}) if closed else ("", {})
    named = [turn[name] for name in REASONING_FIELDS if isinstance(turn.get(name), str) and turn[name].strip()]
    reasoning = named[0] if named else reasoning
    return found | ({"reasoning_content": reasoning} if reasoning.strip() else {})


def _placed_images(messages: list[dict[str, Any]], record: dict[str, Any]) -> list[dict[str, Any]]:
    """User turns' `<|image|>` placeholders replaced by image parts holding the record's images, in order."""
    placeholders = sum(m["content"].count(IMAGE_PLACEHOLDER) for m in messages
                       if m["role"] == "user" and isinstance(m["content"], str))
    if not placeholders:
        return messages
    images = record.get("images", record.get("image"))
    images = [images] if isinstance(images, str) else images if isinstance(images, list) else []
    if len(images) < placeholders:
        raise InvalidConversation("image_missing")
    if not all(isinstance(image, str) and image for image in images):
        raise InvalidConversation("malformed_image")
    remaining = iter(images)
    for message in messages:
        if message["role"] == "user" and isinstance(message["content"], str) and IMAGE_PLACEHOLDER in message["content"]:
            pieces = message["content"].split(IMAGE_PLACEHOLDER)
            parts = [{"type": "text", "text": pieces[0]}]
            for piece in pieces[1:]:
                parts += [{"type": "image", "image": next(remaining)}, {"type": "text", "text": piece}]
            message["content"] = [part for part in parts if part["type"] == "image" or part["text"]]
    return messages


def _role(turn: Any, role_key: str, roles: dict[str, str]) -> str:
    if not isinstance(turn, dict) or turn.get(role_key) is None:
        raise InvalidConversation("missing_role")
    role = roles.get(turn[role_key]) if isinstance(turn[role_key], str) else None
    if role is None:
        raise InvalidConversation("unknown_role")
    return role


def _tool_call(call: Any) -> dict[str, Any]:
    """An OpenAI tool call with a string id, a function name and arguments (a JSON string or an object)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not (isinstance(function, dict) and isinstance(function.get("name"), str) and isinstance(call.get("id"), str)
            and isinstance(function.get("arguments"), (str, dict))):
        raise InvalidConversation("malformed_tool_call")
    return {"id": call["id"], "type": "function",
            "function": {"name": function["name"], "arguments": function["arguments"]}}


def _sharegpt_message(turn: Any) -> dict[str, Any]:
    """A ShareGPT turn; a `function_call` turn becomes an assistant turn whose calls have no id yet."""
    if not (isinstance(turn, dict) and turn.get("from") == "function_call"):
        return _message(turn, "from", "value", SHAREGPT_ROLES)
    calls = _parse_json(turn.get("value"), "malformed_tool_call")
    calls = calls if isinstance(calls, list) else [calls]
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise InvalidConversation("malformed_tool_call")
    return {"role": "assistant", "content": "",
            "tool_calls": [{"function": {"name": c["name"], "arguments": c.get("arguments", {})}} for c in calls]}


def _kimi_mtp_message(turn: Any) -> dict[str, Any]:
    """A kimi-mtp-dataset turn: the tool calls of an assistant turn taken out of its text (its inline reasoning
    `_message` takes), a user turn's JSON-encoded content parts decoded."""
    message = _message(turn, "from", "value", SHAREGPT_ROLES)
    text = message["content"]
    if message["role"] != "assistant":
        parts = _content_parts(text) if message["role"] == "user" else None
        if parts is not None:
            message["content"] = [_part(part) for part in parts]
        return message
    section_start, section_end = KIMI_TOOL_CALLS
    if section_start in text:
        text, section = text.split(section_start, 1)
        if not section.rstrip().endswith(section_end):
            raise InvalidConversation("malformed_tool_call")
        message["tool_calls"] = [_kimi_tool_call(call) for call in section.rstrip()[: -len(section_end)]
                                 .split(KIMI_TOOL_CALL[0])[1:]]
    elif not text.strip():
        raise InvalidConversation("empty_content")
    message["content"] = text
    return message


def _content_parts(text: str) -> list[dict[str, Any]] | None:
    """The OpenAI content parts a JSON-encoded user turn holds, or None when the text is just text."""
    if not text.lstrip().startswith("[{"):
        return None
    try:
        parts = json.loads(text)
    except json.JSONDecodeError:
        return None
    is_parts = isinstance(parts, list) and all(isinstance(part, dict) and "type" in part for part in parts)
    return parts if is_parts else None


def _kimi_tool_call(call: str) -> dict[str, Any]:
    """One `ID<|tool_call_argument_begin|>ARGS<|tool_call_end|>` of Kimi's section (ID `functions.NAME:IDX`)."""
    call_id, separator, arguments = call.partition(KIMI_TOOL_CALL[1])
    name = call_id.strip().removeprefix("functions.").rpartition(":")[0]
    if not (separator and name and arguments.rstrip().endswith(KIMI_TOOL_CALL[2])):
        raise InvalidConversation("malformed_tool_call")
    return _tool_call({"id": call_id.strip(), "function": {"name": name,
                                                          "arguments": arguments.rstrip()[: -len(KIMI_TOOL_CALL[2])]}})


def _answer_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give calls without an id (ShareGPT's) Kimi-style ids, and each tool result the id of the oldest call it
    has not answered."""
    unanswered: list[str] = []
    calls_made = 0
    for message in messages:
        calls = message.get("tool_calls", [])
        ids = [call.get("id") or f"functions.{call['function']['name']}:{calls_made + k}" for k, call in enumerate(calls)]
        if calls:
            message["tool_calls"] = [_tool_call(call | {"id": call_id}) for call, call_id in zip(calls, ids)]
        unanswered += ids
        calls_made += len(ids)
        if message["role"] == "tool":
            if not unanswered:
                raise InvalidConversation("unanswerable_tool_result")
            message["tool_call_id"] = unanswered.pop(0)
    return messages


def _parse_json(text: Any, reason: str) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise InvalidConversation(reason) from None


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and (part.get("type") in IMAGE_PARTS or bool(IMAGE_PARTS & part.keys()))


def _part(part: Any) -> dict[str, str]:
    """A text or image content part in the shape the templates read; an image's source is its path or data URL."""
    if _is_image(part):
        source = part.get("image_url", part.get("image"))
        source = source.get("url") if isinstance(source, dict) else source
        if not isinstance(source, str) or not source:
            raise InvalidConversation("malformed_image")
        return {"type": "image", "image": source}
    if not (isinstance(part, dict) and isinstance(part.get("text"), str)):
        raise InvalidConversation("non_string_content")
    return {"type": "text", "text": part["text"]}


def image_sources(messages: list[dict[str, Any]]) -> list[str]:
    """The images of a conversation, in the order its turns show them."""
    return [part["image"] for m in messages if isinstance(m["content"], list) for part in m["content"]
            if part["type"] == "image"]


def _text(content: Any, empty_allowed: bool = False) -> str:
    """A string, or OpenAI content parts that are all text (joined); anything else is skipped (an image in an
    assistant turn: images_unsupported, as the draft never writes one). Only tool results and assistant turns
    that call tools may be empty (None reads as empty there)."""
    if content is None and empty_allowed:
        return ""
    if isinstance(content, list) and any(_is_image(part) for part in content):
        raise InvalidConversation("images_unsupported")
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise InvalidConversation("non_string_content")
    if not content.strip() and not empty_allowed:
        raise InvalidConversation("empty_content")
    return content


def up_to_last_answer(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation through its last assistant turn (turns after it teach the draft nothing)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise InvalidConversation("no_assistant_turn")
    return messages[: last + 1]


def through_first_user_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation through its first user turn: what a prompt-only record asks before any answer (its later
    user turns follow answers it does not have)."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "user"), len(messages) - 1)
    return messages[: first + 1]
