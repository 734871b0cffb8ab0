"""Conversations in one shape whatever schema they came in, and the bookkeeping of skipped records.

A message is a dict `{"role": "system"|"user"|"assistant"|"tool", "content": str}`; an assistant message may
also carry `reasoning_content` (OpenAI-style reasoning, as Kimi's API returns it) and, when the target wrote
it in this stage, `completion` (its raw output text) and `finished` (it ended with its end-of-turn token).
A record that cannot become a valid conversation raises `InvalidConversation` with a short reason; the
stage counts reasons instead of failing on them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from eagle3_pipeline.config import SourceConfig

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "system": "system", "tool": "tool", "observation": "tool"}
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
    """The messages of one record in ShareGPT (`conversations`: from/value) or OpenAI (`messages`: role/content)."""
    if not isinstance(record, dict):  # also a JSON line that did not parse (the reader yields None)
        raise InvalidConversation("malformed_json")
    if schema == "auto":
        schema = "messages" if "messages" in record else "sharegpt"
    turns = record.get("messages" if schema == "messages" else "conversations")
    if not isinstance(turns, list) or not turns:
        raise InvalidConversation("no_messages")
    if schema == "messages":
        return [_message(turn, "role", "content", {role: role for role in ROLES}) for turn in turns]
    return [_message(turn, "from", "value", SHAREGPT_ROLES) for turn in turns]


def _message(turn: Any, role_key: str, content_key: str, roles: dict[str, str]) -> dict[str, Any]:
    if not isinstance(turn, dict) or turn.get(role_key) is None:
        raise InvalidConversation("missing_role")
    role = roles.get(turn[role_key]) if isinstance(turn[role_key], str) else None
    if role is None:
        raise InvalidConversation("unknown_role")
    message = {"role": role, "content": _text(turn.get(content_key))}
    reasoning = turn.get("reasoning_content")
    if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
        message["reasoning_content"] = reasoning
    return message


def _text(content: Any) -> str:
    """A string, or OpenAI content parts that are all text (joined); anything else is skipped."""
    if isinstance(content, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise InvalidConversation("non_string_content")
    if not content.strip():
        raise InvalidConversation("empty_content")
    return content


def up_to_last_answer(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation through its last assistant turn (turns after it teach the draft nothing)."""
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise InvalidConversation("no_assistant_turn")
    return messages[: last + 1]
