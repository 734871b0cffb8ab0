"""Kimi's tiktoken tokenizer for the tiny Kimi-K2.5 stand-in, loaded as remote code (`trust_remote_code`).

Written for this project after the public behaviour of the `tokenization_kimi.py` that moonshotai ships with
Kimi-K2 / K2.5, which transformers and vLLM load through `auto_map` in tokenizer_config.json:

- `TikTokenTokenizer`, a Python (slow) tokenizer over a `tiktoken.Encoding`: the BPE ranks file
  `tiktoken.model` (base64 token and rank per line), Kimi's pre-tokenizer pattern, and 256 special slots
  right after the ordinary tokens, named by tokenizer_config.json's `added_tokens_decoder`
  (`<|reserved_token_N|>` where it names none).
- `encode(text)` without keywords is tiktoken's, special tokens included; with keywords it is the
  transformers path (added tokens split first). `decode` likewise.
- Token strings are GPT-2 style byte-level text (each byte one printable character). Decoding with
  `skip_special_tokens` drops only the chat-format tokens (`CHAT_FORMAT_SPECIALS`).
- `apply_chat_template` defaults to `tokenize=False, add_generation_prompt=True`, sorts the keys of the tool
  declarations and hands the template `tools_ts_str`: the tools declared in TypeScript style, as Kimi-K2.5's
  does (`# Tools`, `## functions`, `namespace functions { ... }`: a commented `type NAME = (_: {...}) => any;` per
  function, optional properties marked `?`, enums as unions of their JSON values); the template is the folder's
  chat_template.jinja.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tiktoken
from tiktoken.load import load_tiktoken_bpe
from transformers import PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}
NUM_SPECIAL_SLOTS = 256
# Kimi's pre-tokenizer: Han runs, cased words with English contractions, up to 3 digits, punctuation runs,
# newlines, other whitespace.
PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# The chat-format tokens that decoding with skip_special_tokens drops (Kimi's list): <think>, the media and the
# tool-call tokens stay in the text, where vLLM's reasoning and tool parsers look for them.
CHAT_FORMAT_SPECIALS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>", "<|end_header_id|>",
                        "[EOT]", "<|im_system|>", "<|im_middle|>"]
# tiktoken fails on very long runs of whitespace or of non-whitespace: such runs are encoded in pieces
MAX_RUN_CHARS = 25_000


def byte_to_char() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values to printable characters (byte-level token strings)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + k) for k, b in enumerate(others)}


def deep_sort(value: Any) -> Any:
    """Dicts with their keys sorted, at every depth (Kimi renders tool declarations this way)."""
    if isinstance(value, dict):
        return {key: deep_sort(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [deep_sort(item) for item in value]
    return value


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, vocab_file: str, bos_token: str = "[BOS]", eos_token: str = "[EOS]", unk_token: str | None = None,
                 pad_token: str | None = None, added_tokens_decoder: dict | None = None, **kwargs: Any):
        ranks = load_tiktoken_bpe(vocab_file)
        names = {int(i): str(token) for i, token in (added_tokens_decoder or {}).items()}
        first = len(ranks)
        self.special_tokens = {names.get(i, f"<|reserved_token_{i}|>"): i for i in range(first, first + NUM_SPECIAL_SLOTS)}
        self.model = tiktoken.Encoding(name=Path(vocab_file).name, pat_str=PAT_STR, mergeable_ranks=ranks,
                                       special_tokens=self.special_tokens)
        self.vocab_file = vocab_file
        to_char = byte_to_char()
        self.byte_of = {char: b for b, char in to_char.items()}
        self.decoder = {i: "".join(to_char[b] for b in self.model.decode_single_token_bytes(i))
                        for i in range(self.model.n_vocab)}
        self.encoder = {token: i for i, token in self.decoder.items()}
        kwargs.setdefault("extra_special_tokens", CHAT_FORMAT_SPECIALS)
        super().__init__(bos_token=bos_token, eos_token=eos_token, unk_token=unk_token, pad_token=pad_token,
                         added_tokens_decoder=added_tokens_decoder, **kwargs)

    # ------------------------------------------------------------------------------- Kimi's fast paths
    def encode(self, text: str, allow_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if kwargs:
            return super().encode(text, **kwargs)
        allowed = "all" if allow_special_tokens else set()
        return [token for piece in _runs_at_most(text, MAX_RUN_CHARS)
                for token in self.model.encode(piece, allowed_special=allowed, disallowed_special=())]

    def decode(self, token_ids: int | list[int], **kwargs: Any) -> str:
        if kwargs:
            return super().decode(token_ids, **kwargs)
        return self.model.decode([token_ids] if isinstance(token_ids, int) else list(token_ids))

    def apply_chat_template(self, conversation, tools: list[dict] | None = None, tokenize: bool = False,
                            add_generation_prompt: bool = True, **kwargs: Any):
        tools = deep_sort(tools)
        if tools:
            kwargs.setdefault("tools_ts_str", tools_typescript(tools))
        return super().apply_chat_template(conversation, tools=tools, tokenize=tokenize,
                                           add_generation_prompt=add_generation_prompt, **kwargs)

    # ------------------------------------------------------------------ what PreTrainedTokenizer needs
    @property
    def vocab_size(self) -> int:
        return self.model.n_vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return [self.decoder[token] for token in self.encode(text)]

    def _convert_token_to_id(self, token: str) -> int:
        return self.encoder.get(token, self.unk_token_id)

    def _convert_id_to_token(self, index: int) -> str:
        return self.decoder[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return bytes(self.byte_of[char] for char in "".join(tokens)).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str]:
        target = os.path.join(save_directory, (f"{filename_prefix}-" if filename_prefix else "") + "tiktoken.model")
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, target)
        return (target,)


JSON_TO_TS = {"string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null"}


def tools_typescript(tools: list[dict]) -> str:
    """OpenAI function declarations as Kimi-K2.5 declares tools to the model, in TypeScript style."""
    functions = [tool.get("function", tool) for tool in tools]
    return "# Tools\n\n## functions\nnamespace functions {\n" + "".join(map(_ts_function, functions)) + "}\n"


def _ts_function(function: dict) -> str:
    comment = f"// {function['description']}\n" if function.get("description") else ""
    parameters = function.get("parameters") or {}
    arguments = f"_: {_ts_type(parameters, 0)}" if parameters.get("properties") else ""
    return f"{comment}type {function['name']} = ({arguments}) => any;\n"


def _ts_type(schema: dict, depth: int) -> str:
    """A JSON schema as a TypeScript type; an object's properties one a line, each after its description."""
    if "enum" in schema:
        return " | ".join(json.dumps(value) for value in schema["enum"])
    kind = schema.get("type")
    if kind == "array":
        return f"{_ts_type(schema.get('items') or {}, depth)}[]"
    if kind == "object" or "properties" in schema:
        indent, required = "  " * (depth + 1), set(schema.get("required") or [])
        lines = []
        for name, value in (schema.get("properties") or {}).items():
            comment = f"{indent}// {value['description']}\n" if value.get("description") else ""
            optional = "" if name in required else "?"
            lines.append(f"{comment}{indent}{name}{optional}: {_ts_type(value, depth + 1)}")
        return "{\n" + ",\n".join(lines) + "\n" + "  " * depth + "}"
    if isinstance(kind, list):
        return " | ".join(JSON_TO_TS.get(k, "any") for k in kind)
    return JSON_TO_TS.get(kind, "any")


def _runs_at_most(text: str, limit: int) -> Iterator[str]:
    """`text` cut so that no piece holds more than `limit` consecutive whitespace or non-whitespace characters."""
    start, run, in_space = 0, 0, text[:1].isspace()
    for i, char in enumerate(text):
        if char.isspace() != in_space:
            run, in_space = 1, char.isspace()
            continue
        run += 1
        if run > limit:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]
