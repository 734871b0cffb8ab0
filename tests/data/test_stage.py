"""Stage 01 through its command line: sources, bad input, errors, and (vLLM) interrupted regeneration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import pytest
from safetensors.numpy import load_file
from transformers import AutoTokenizer

from eagle3_pipeline.config import load_config
from eagle3_pipeline.data import stage as prepare_data
from eagle3_pipeline.data.dataset import read_stats
from eagle3_pipeline.target import target_path
from tests.conftest import CONFIGS, ROOT, EngineStarted, record_engine_starts, run_python

CONVERSATIONS = [
    [("system", "Answer in one line."), ("user", "Capital of France?"), ("assistant", "Paris.")],
    [("user", "Hi"), ("assistant", "Hello! How can I help?"), ("user", "Tell me a joke."),
     ("assistant", "Why did the cat sit on the laptop? To keep an eye on the mouse.")],
]
SHAREGPT_ROLE = {"system": "system", "user": "human", "assistant": "gpt"}
GOOD = {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]}
DEFECTS = {  # reason -> one record (or raw line) with exactly that defect
    "malformed_json": '{"messages": [{"role": "user", "content": "cut',
    "no_messages": {"text": "a plain document"},
    "missing_role": {"messages": [{"content": "Say hi."}, {"role": "assistant", "content": "Hi!"}]},
    "unknown_role": {"messages": [{"role": "wizard", "content": "Hi"}, {"role": "assistant", "content": "Hi!"}]},
    "empty_content": {"messages": [{"role": "user", "content": "  "}, {"role": "assistant", "content": "Hi!"}]},
    "non_string_content": {"messages": [{"role": "user", "content": 42}, {"role": "assistant", "content": "Hi!"}]},
    "no_assistant_turn": {"messages": [{"role": "user", "content": "Anyone there?"}]},
    "assistant_first": {"messages": [{"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Hi."}]},
    "no_loss_tokens": {"messages": [{"role": "user", "content": "word " * 200}, {"role": "assistant", "content": "K"}]},
}


def write_jsonl(path: Path, records: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def as_messages(conversation) -> dict:
    return {"messages": [{"role": role, "content": text} for role, text in conversation]}


def as_sharegpt(conversation) -> dict:
    return {"conversations": [{"from": SHAREGPT_ROLE[role], "value": text} for role, text in conversation]}


def prepare(tmp_path: Path, *overrides: str, run: str = "run") -> subprocess.CompletedProcess:
    """01_prepare_data.py on the demo config without generation, with `overrides`."""
    return run_python("01_prepare_data.py", "--config", str(CONFIGS / "demo.yaml"),
                      "--set", f"run_dir={tmp_path / run}", "--set", "data.regenerate.enabled=false",
                      "--set", "data.eval_sources=[]", *overrides, timeout=300)


def prepare_in_process(tmp_path: Path, sources: list[dict], run: str) -> list[dict]:
    config = load_config(CONFIGS / "demo.yaml", [
        f"run_dir={tmp_path / run}", f"data.sources={json.dumps(sources)}", "data.eval_sources=[]",
        "data.regenerate.enabled=false"])
    prepare_data.run(config)
    return datasets.load_from_disk(str(tmp_path / run / "01_data" / "train")).to_list()


def test_one_bad_record_of_each_kind_is_counted_and_the_good_rows_kept(tmp_path):
    data = write_jsonl(tmp_path / "mixed.jsonl", [GOOD, *DEFECTS.values(), GOOD])
    result = prepare(tmp_path, "--set", f"data.sources=[{{kind: file, name: {data}}}]", "--set", "data.max_seq_len=64")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "run" / "01_data"
    stats = read_stats(out)
    expected_ids = {reason: [f"mixed-{i + 1}"] for i, reason in enumerate(DEFECTS)}
    assert stats["skipped"] == {reason: {"count": 1, "first_ids": ids} for reason, ids in expected_ids.items()}
    train = datasets.load_from_disk(str(out / "train"))
    assert train["id"] == ["mixed-0", f"mixed-{len(DEFECTS) + 1}"] and train["source"] == ["mixed", "mixed"]
    assert train.features["input_ids"].feature.dtype == "int32" and train.features["loss_mask"].feature.dtype == "int8"
    assert train["seq_len"] == [len(ids) for ids in train["input_ids"]]
    counts = load_file(str(out / "token_freq.safetensors"))["counts"]
    assert counts.dtype.name == "int64" and counts.shape == (49152,)
    assert counts.sum() == sum(sum(mask) for mask in train["loss_mask"]) == stats["train"]["loss_tokens"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["counts"]["train_samples"] == 2 and manifest["counts"]["skipped"] == len(DEFECTS)


def test_overlong_samples_are_dropped_or_truncated_as_configured(tmp_path):
    data = write_jsonl(tmp_path / "long.jsonl", [GOOD, as_messages(CONVERSATIONS[1])])
    source = f"data.sources=[{{kind: file, name: {data}}}]"
    dropped = prepare(tmp_path, "--set", source, "--set", "data.max_seq_len=40", "--set", "data.overlong=drop",
                      run="drop")
    assert dropped.returncode == 0, dropped.stderr
    stats = read_stats(tmp_path / "drop" / "01_data")
    assert stats["skipped"] == {"overlong": {"count": 1, "first_ids": ["long-1"]}}
    truncated = prepare(tmp_path, "--set", source, "--set", "data.max_seq_len=40", run="truncate")
    assert truncated.returncode == 0, truncated.stderr
    stats = read_stats(tmp_path / "truncate" / "01_data")
    assert stats["train"]["truncated"] == 1 and stats["train"]["samples"] == 2 and stats["skipped"] == {}
    assert max(datasets.load_from_disk(str(tmp_path / "truncate" / "01_data" / "train"))["seq_len"]) == 40


def test_no_valid_sample_exits_1_naming_the_reasons(tmp_path):
    data = write_jsonl(tmp_path / "bad.jsonl", [DEFECTS["unknown_role"], DEFECTS["malformed_json"]])
    result = prepare(tmp_path, "--set", f"data.sources=[{{kind: file, name: {data}}}]")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: no valid training samples (malformed_json 1 (first: bad-1), unknown_role 1 (first: bad-0))")


def test_missing_file_and_unknown_dataset_are_one_line_config_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a dataset name that is not a local folder must not reach the hub
    nope = tmp_path / "nope.jsonl"
    missing = prepare(tmp_path, "--set", f"data.sources=[{{kind: file, name: {nope}}}]")
    assert not (tmp_path / "run" / "01_data").exists()  # nothing begun: fixing the config needs no --force
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"config error: data source file '{nope}': no such file"]
    unknown = prepare(tmp_path, "--set", f"data.sources=[{{kind: hf, name: {tmp_path / 'no_such_dataset'}}}]")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    assert "data source hf" in unknown.stderr and "no_such_dataset" in unknown.stderr


def test_sharegpt_and_messages_files_give_identical_rows(tmp_path):
    sharegpt = write_jsonl(tmp_path / "sharegpt" / "chats.jsonl", [as_sharegpt(c) for c in CONVERSATIONS])
    messages = write_jsonl(tmp_path / "messages" / "chats.jsonl", [as_messages(c) for c in CONVERSATIONS])
    from_sharegpt = prepare_in_process(tmp_path, [{"kind": "file", "name": str(sharegpt), "schema": "sharegpt"}], "a")
    from_messages = prepare_in_process(tmp_path, [{"kind": "file", "name": str(messages)}], "b")
    assert len(from_sharegpt) == len(CONVERSATIONS) and from_sharegpt == from_messages


def test_json_parquet_and_hf_dataset_folders_read_like_jsonl(tmp_path):
    records = [as_messages(c) for c in CONVERSATIONS]
    folder = tmp_path / "chats"  # every source is named "chats": same ids, so whole rows compare
    write_jsonl(folder / "chats.jsonl", records)
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "chats.json").write_text(json.dumps(records))
    (tmp_path / "parquet").mkdir()
    datasets.Dataset.from_list(records).to_parquet(str(tmp_path / "parquet" / "chats.parquet"))
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "saved" / "chats"))
    reference = prepare_in_process(tmp_path, [{"kind": "file", "name": str(folder / "chats.jsonl")}], "jsonl")
    for name, source in {
        "json": {"kind": "file", "name": str(tmp_path / "json" / "chats.json")},
        "parquet": {"kind": "file", "name": str(tmp_path / "parquet" / "chats.parquet")},
        "hf_files": {"kind": "hf", "name": str(folder)},  # datasets.load_dataset on a local folder
        "hf_saved": {"kind": "hf", "name": str(tmp_path / "saved" / "chats")},  # a save_to_disk folder
    }.items():
        assert prepare_in_process(tmp_path, [source], name) == reference, name


def test_sources_mix_with_limits_and_eval_fraction_holds_out(tmp_path):
    data = write_jsonl(tmp_path / "many.jsonl", [as_messages(CONVERSATIONS[i % 2]) for i in range(10)])
    result = prepare(tmp_path, "--set", f"data.sources=[{{kind: file, name: {data}, limit: 6}}, "
                     f"{{kind: file, name: {data}, skip: 7, limit: 2}}]", "--set", "data.eval_fraction=0.25")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "run" / "01_data"
    train, held_out = (datasets.load_from_disk(str(out / split)) for split in ("train", "eval"))
    # 2 conversations held out; one of two answers (odd index) is served as 2 prompts, one per turn
    conversations = {row_id.split("-turn")[0] for row_id in held_out["id"]}
    assert len(train) == 6 and len(conversations) == 2
    assert len(held_out) == sum(2 if int(c.rsplit("-", 1)[1]) % 2 else 1 for c in conversations)
    assert not set(train["id"]) & conversations
    assert set(train["id"]) | conversations == {f"many-{i}" for i in range(6)} | {"many.2-7", "many.2-8"}
    tokenizer = AutoTokenizer.from_pretrained(str(target_path(load_config(CONFIGS / "demo.yaml").target)))
    for row in held_out:  # the prompt: the conversation up to the last answer's generation prompt
        prompt_len = len(row["prompt_ids"])
        assert row["input_ids"][:prompt_len] == row["prompt_ids"]
        assert tokenizer.decode(row["prompt_ids"]).endswith("<|im_start|>assistant\n")
        assert row["loss_mask"][prompt_len - 1] == 0 and row["loss_mask"][prompt_len] == 1


@pytest.mark.vllm
def test_killed_regeneration_resumes_and_generates_every_sample_once(tmp_path):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [as_messages([("user", q)]) for q in ("Name a fruit.", "Hi!")])
    command = [sys.executable, "01_prepare_data.py", "--config", str(CONFIGS / "demo.yaml"),
               "--set", f"run_dir={tmp_path / 'run'}",
               "--set", "data.sources=[{kind: magpie, limit: 6, max_tokens: 24}]",
               "--set", f"data.eval_sources=[{{kind: file, name: {prompts}}}]",
               "--set", "data.regenerate.max_tokens=16", "--set", "data.regenerate.chunk_size=2"]
    chunks = tmp_path / "run" / "01_data" / "generated"
    first = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # its own process group: the kill takes vLLM's too
    deadline = time.time() + 240
    while not (chunks / "chunk-00000.jsonl").exists() and first.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    kept = {path.name: (path.stat().st_mtime_ns, path.read_text()) for path in chunks.glob("chunk-*.jsonl")}
    assert 1 <= len(kept) < 4, "the kill should land after the first chunk and before the last"

    # resumed under other runtime knobs: the chunks the work began with are kept, whatever chunk_size says now
    resumed_with = ["--set", "data.regenerate.chunk_size=3", "--set", "target.engine.max_num_seqs=5"]
    second = subprocess.run(command + resumed_with, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "resuming in the pieces its work began with: data.regenerate.chunk_size 2" in second.stdout
    assert f"8 conversations in 4 chunks, {len(kept)} already done" in second.stdout
    for name, (mtime, text) in kept.items():  # finished chunks were read, not generated again
        assert (chunks / name).stat().st_mtime_ns == mtime and (chunks / name).read_text() == text
    generated = [json.loads(line)["id"] for path in sorted(chunks.glob("chunk-*.jsonl"))
                 for line in path.read_text().splitlines()]
    assert sorted(generated) == sorted([f"magpie-{i}" for i in range(6)] + ["prompts-0", "prompts-1"])

    out = tmp_path / "run" / "01_data"
    stats = read_stats(out)
    train, held_out = (datasets.load_from_disk(str(out / split)) for split in ("train", "eval"))
    skipped = sum(reason["count"] for reason in stats["skipped"].values())
    assert len(train) + len(held_out) + skipped == 8 and held_out["id"] == ["prompts-0", "prompts-1"]
    assert stats["generation"]["answers_generated"] == 8 - stats["skipped"].get("empty_generation", {}).get("count", 0)


KIMI_RECORDS = [  # plain chats, and a thinking-mode agentic one (no `tools`: Kimi's tokenizer sorts their keys)
    *(as_messages(c) for c in CONVERSATIONS),
    {"messages": [
        {"role": "user", "content": "Weather in Paris? Answer in 12 words."},
        {"role": "assistant", "content": "", "reasoning_content": "Ask the tool.",
         "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "18 C, cloudy"},
        {"role": "assistant", "content": "It is 18 C and cloudy in Paris.", "reasoning_content": "Known now."}]},
]
KIMI_IDS = {"<|im_system|>": 163594, "<|im_user|>": 163587, "<|im_assistant|>": 163588, "<|im_middle|>": 163601,
            "<|im_end|>": 163586, "<think>": 163606, "</think>": 163607, "<|tool_calls_section_begin|>": 163595}


def test_tiny_kimi_remote_code_tokenizer_gives_the_rows_of_the_fast_one_with_kimis_special_ids(tmp_path):
    """01 through Kimi's remote-code TikTokenTokenizer (configs/tiny_kimi.yaml) writes exactly the rows of the
    fast tokenizer, and the chat format's tokens are Kimi's single ids where the template writes them."""
    data = write_jsonl(tmp_path / "kimi.jsonl", KIMI_RECORDS)
    rows = {}
    for form, settings in {"tiktoken": [], "fast": ["target.stand_in=tiny-kimi-k25", "target.trust_remote_code=false"]
                           }.items():
        config = load_config(CONFIGS / "tiny_kimi.yaml", [
            f"run_dir={tmp_path / form}", f"data.sources=[{{kind: file, name: {data}}}]", "data.eval_fraction=0",
            "data.regenerate.enabled=false", "data.max_seq_len=1024", *settings])
        prepare_data.run(config)
        rows[form] = datasets.load_from_disk(str(tmp_path / form / "01_data" / "train")).to_list()
    assert len(rows["tiktoken"]) == len(KIMI_RECORDS) and rows["tiktoken"] == rows["fast"]
    for row in rows["tiktoken"]:
        ids, mask = row["input_ids"], row["loss_mask"]
        first_role = "<|im_system|>" if row["id"].endswith("-0") else "<|im_user|>"  # K2.5 adds no system turn
        assert ids[0] == KIMI_IDS[first_role] and ids[-1] == KIMI_IDS["<|im_end|>"] and mask[-1] == 1
        # the last turn: <|im_assistant|>assistant<|im_middle|><think> is the prompt; its reasoning (the agentic
        # record's final answer has some), </think> and the answer are trained
        header = len(ids) - 1 - ids[::-1].index(KIMI_IDS["<|im_assistant|>"])
        opened = ids.index(KIMI_IDS["<think>"], header)
        reasoning_tokens = ids.index(KIMI_IDS["</think>"], opened) - opened - 1
        assert ids[opened - 1] == KIMI_IDS["<|im_middle|>"]
        assert (reasoning_tokens > 0) == (row is rows["tiktoken"][-1])
        assert mask[opened] == 0 and all(mask[opened + 1:])
    agentic = rows["tiktoken"][-1]["input_ids"]
    assert agentic.count(KIMI_IDS["<|tool_calls_section_begin|>"]) == 1


def test_a_remote_code_tokenizer_without_trust_remote_code_is_a_one_line_config_error(tmp_path, capsys):
    from tests.test_unusual_runs import config_file, stage

    config = config_file(tmp_path, "tiny_kimi", ["target.trust_remote_code=false"])
    result = stage(capsys, "01_prepare_data.py", config)
    assert result.code == 2 and result.error_line().startswith("config error: target ")
    assert "tokenization_kimi.TikTokenTokenizer in tokenizer_config.json's auto_map" in result.error_line()
    assert "target.trust_remote_code: true" in result.error_line()


def test_a_text_only_target_skips_image_conversations_by_reason(tmp_path):
    from PIL import Image

    Image.new("RGB", (32, 32), (200, 40, 40)).save(tmp_path / "red.png")
    image = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What colour is this?"},
                                                       {"type": "image_url", "image_url": {"url": str(tmp_path / "red.png")}}]},
                          {"role": "assistant", "content": "Red."}]}
    data = write_jsonl(tmp_path / "mixed.jsonl", [GOOD, image])
    result = prepare(tmp_path, "--set", f"data.sources=[{{kind: file, name: {data}}}]")
    assert result.returncode == 0, result.stderr
    stats = read_stats(tmp_path / "run" / "01_data")
    assert stats["skipped"] == {"images_unsupported": {"count": 1, "first_ids": ["mixed-1"]}}
    assert stats["train"]["samples"] == 1 and stats["train"]["image_tokens"] == 0


@pytest.mark.parametrize("with_images", [False, True])
def test_01_starts_the_target_text_only_unless_a_conversation_has_images(tmp_path, monkeypatch, with_images):
    """A multimodal target's engine loads and profiles no vision tower when no prompt carries images
    (tests/test_engine.py: what start_engine makes of text_only; tests/capture/test_stage.py: that vLLM honours it)."""
    from eagle3_pipeline.data import generate
    from eagle3_pipeline.stand_ins.tiny_kimi import write_image_chat

    started = record_engine_starts(monkeypatch, generate)
    sources = [f"{{kind: file, name: {write_jsonl(tmp_path / 'kimi.jsonl', KIMI_RECORDS)}}}"]
    if with_images:
        sources.append(f"{{kind: file, name: {write_image_chat(tmp_path)}}}")
    config = load_config(CONFIGS / "tiny_kimi.yaml", [
        f"run_dir={tmp_path / 'run'}", f"data.sources=[{', '.join(sources)}]", "data.eval_sources=[]",
        "data.regenerate.enabled=true"])
    with pytest.raises(EngineStarted):
        prepare_data.run(config)
    assert [settings["text_only"] for settings in started] == [not with_images]
