"""The tiny Kimi's tokenizer and chat template (`tiny_kimi.build` writes them beside the weights).

Kimi's special tokens sit at their real ids; the ordinary tokens come from a byte-level BPE trained on a fixed
text (the assets' bpe_corpus.txt) with Kimi's pre-tokenizer pattern. `write_tokenizer` writes it in one of two
forms with the same ids:
- `fast`: a tokenizer.json that any loader reads;
- `tiktoken`: what the real checkpoint ships, Kimi's remote-code `TikTokenTokenizer`
  (`tokenization_kimi.py` from the assets, a `tiktoken.model` ranks file, `auto_map` in
  tokenizer_config.json), loaded only with `trust_remote_code`.
"""

from __future__ import annotations

import functools
import json
import pathlib
import shutil

ASSETS = pathlib.Path(__file__).with_name("tiny_kimi_assets")
TOKENIZERS = ("fast", "tiktoken")  # the forms the tokenizer is written in

# --- Kimi's token ids (moonshotai Kimi-K2 / K2.5 tokenizer_config.json, added_tokens_decoder) ---
VOCAB_SIZE = 163840
FIRST_SPECIAL_ID = 163584  # ids below are ordinary BPE tokens; the last 256 ids are special slots
BOS_ID, EOS_ID, MEDIA_PAD_ID, PAD_ID = 163584, 163585, 163605, 163839
SPECIAL_TOKENS = {
    163584: "[BOS]",
    163585: "[EOS]",
    163586: "<|im_end|>",
    163587: "<|im_user|>",
    163588: "<|im_assistant|>",
    163590: "<|start_header_id|>",
    163591: "<|end_header_id|>",
    163593: "[EOT]",
    163594: "<|im_system|>",
    163595: "<|tool_calls_section_begin|>",
    163596: "<|tool_calls_section_end|>",
    163597: "<|tool_call_begin|>",
    163598: "<|tool_call_argument_begin|>",
    163599: "<|tool_call_end|>",
    163601: "<|im_middle|>",
    163602: "<|media_begin|>",
    163603: "<|media_content|>",
    163604: "<|media_end|>",
    163605: "<|media_pad|>",
    163606: "<think>",
    163607: "</think>",
    163838: "[UNK]",
    163839: "[PAD]",
}
# Kimi-K2.5 marks the tool-call and reasoning markers non-special, so decoding with skip_special_tokens keeps
# them for the tool and reasoning parsers.
NON_SPECIAL_IDS = frozenset([*range(163595, 163600), 163606, 163607])
# what Kimi-K2.5's tokenizer_config.json lists as additional special tokens: the chat format and the media tokens
ADDITIONAL_SPECIAL_TOKENS = ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                             "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>", "<|media_begin|>",
                             "<|media_content|>", "<|media_end|>", "<|media_pad|>"]


def write_tokenizer(out_dir: pathlib.Path, form: str, model_max_length: int) -> None:
    """The tokenizer in form `form` (one of TOKENIZERS) and Kimi-K2.5's chat template, into `out_dir`."""
    vocab = _trained_vocab()
    (_write_fast_tokenizer if form == "fast" else _write_tiktoken_tokenizer)(out_dir, vocab, model_max_length)
    shutil.copyfile(ASSETS / "chat_template.jinja", out_dir / "chat_template.jinja")


def _trained_vocab() -> dict[str, int]:
    """Byte-level token string -> id: a BPE trained on a fixed text with Kimi's pre-tokenizer pattern, ids in
    training order (so a token's id is its merge rank, as tiktoken needs), padded up to FIRST_SPECIAL_ID.

    Ids between the trained vocabulary and the special block exist in Kimi's vocabulary; here they are
    unreachable placeholders (no merge produces them), so a random model can still emit and decode every id."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=4096,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((ASSETS / "bpe_corpus.txt").read_text().splitlines(), trainer)
    vocab = tok.get_vocab()
    return vocab | {f"<|unused_{i}|>": i for i in range(len(vocab), FIRST_SPECIAL_ID)}


def _pre_tokenizer():
    """Kimi's pattern, then the byte-level mapping (what transformers builds from a tiktoken tokenizer)."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_kimi_tokenizer_module().PAT_STR), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


@functools.cache
def _kimi_tokenizer_module():
    """The assets' tokenization_kimi.py as a module (its pattern and byte map are the stand-in's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tiny_kimi_tokenization", ASSETS / "tokenization_kimi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _special_tokens():
    """(id, text, special) for ids FIRST_SPECIAL_ID..VOCAB_SIZE-1 in id order (Kimi's reserved slots too)."""
    return [(i, SPECIAL_TOKENS.get(i, f"<|reserved_token_{i}|>"), i not in NON_SPECIAL_IDS)
            for i in range(FIRST_SPECIAL_ID, VOCAB_SIZE)]


NAMED_SPECIALS = {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"}


def _write_fast_tokenizer(out_dir: pathlib.Path, vocab: dict[str, int], model_max_length: int) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(vocab)))
    tok.pre_tokenizer = _pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(text, special=special, normalized=False) for _, text, special in _special_tokens()])
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=model_max_length,
                                     **NAMED_SPECIALS)
    wrong = {c: i for i, c in SPECIAL_TOKENS.items() if hf_tok.convert_tokens_to_ids(c) != i}
    if wrong:
        raise RuntimeError(f"special tokens not at Kimi's ids: {wrong}")
    hf_tok.save_pretrained(out_dir)


def _merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to tiktoken's rank order: for each token (by id) every split into two tokens,
    earlier-ranked pieces first (the construction transformers' tiktoken converter uses)."""
    merges = []
    for token, rank in sorted(vocab.items(), key=lambda item: item[1]):
        splits = [(token[:k], token[k:]) for k in range(1, len(token))
                  if vocab.get(token[:k], rank) < rank and vocab.get(token[k:], rank) < rank]
        merges += sorted(splits, key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
    return merges


def _write_tiktoken_tokenizer(out_dir: pathlib.Path, vocab: dict[str, int], model_max_length: int) -> None:
    """tiktoken.model (base64 bytes and rank per line), the tokenizer class, and a tokenizer_config.json that
    names it in `auto_map` and lists the special tokens, as Kimi-K2.5's folder does."""
    import base64

    byte_of = {char: b for b, char in _kimi_tokenizer_module().byte_to_char().items()}
    lines = [base64.b64encode(bytes(byte_of[c] for c in token)).decode() + f" {rank}\n"
             for token, rank in sorted(vocab.items(), key=lambda item: item[1])]
    (out_dir / "tiktoken.model").write_text("".join(lines))
    shutil.copyfile(ASSETS / "tokenization_kimi.py", out_dir / "tokenization_kimi.py")
    added = {str(i): {"content": text, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                      "special": special} for i, text, special in _special_tokens()}
    config = {
        "added_tokens_decoder": added,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "tokenizer_class": "TikTokenTokenizer",
        "additional_special_tokens": ADDITIONAL_SPECIAL_TOKENS,
        "model_max_length": model_max_length,
        **NAMED_SPECIALS,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
