"""BFCL v4 prompts from the bfcl-eval wheel: its questions, and its functions as the tools BFCL's own code sends an
OpenAI-style model; rendered through the tiny Kimi's template, refused by SmolLM2's, which has no place for tools."""

from __future__ import annotations

import ast
import copy
import json
import re
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from eagle3_pipeline.config_sections import BFCL_CATEGORIES, DataConfig, SourceConfig
from eagle3_pipeline.data import sources
from eagle3_pipeline.data.bfcl import to_openai
from eagle3_pipeline.data.chat_template import ChatTemplate, load_tokenizer
from eagle3_pipeline.data.conversations import Conversation, InvalidConversation, Skips
from eagle3_pipeline.data.generate import Rewrite
from eagle3_pipeline.data.samples import to_rows
from tests.conftest import CONFIGS, run_python

WHEEL = Path(metadata.distribution("bfcl-eval").locate_file("bfcl_eval"))
DEFAULT = ["simple_python", "multiple", "parallel", "parallel_multiple"]
DATA = DataConfig(sources=[SourceConfig(kind="bfcl")], max_seq_len=4096)


def wheel_records(category: str) -> list[dict]:
    """A category's file read independently of sources.py: JSON lines under a .json name."""
    text = (WHEEL / "data" / f"BFCL_v4_{category}.json").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def load(skips: Skips | None = None, **fields) -> list[Conversation]:
    return sources.load_conversations(SourceConfig(kind="bfcl", **fields), "bfcl", skips or Skips())


def function(conversation: Conversation, name: str) -> dict:
    [declaration] = [tool["function"] for tool in conversation.tools if tool["function"]["name"] == name]
    return declaration


def bfcl_code() -> dict:
    """BFCL's own conversion functions compiled from the wheel's source: their modules import packages the
    data-only install leaves out (tree_sitter, tenacity, ...), so only these functions are taken out with ast."""
    from bfcl_eval.constants.enums import ModelStyle
    from bfcl_eval.constants.type_mappings import GORILLA_TO_OPENAPI

    namespace = {"copy": copy, "json": json, "re": re, "ModelStyle": ModelStyle,
                 "GORILLA_TO_OPENAPI": GORILLA_TO_OPENAPI}
    for file, names in (("model_handler/utils.py", {"_cast_to_openai_type", "convert_to_tool"}),
                        ("utils.py", {"is_java", "is_js", "_get_language_specific_hint",
                                      "_func_doc_language_specific_pre_processing"})):
        tree = ast.parse((WHEEL / file).read_text())
        functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
        assert {f.name for f in functions} == names
        code = compile(ast.Module(body=functions, type_ignores=[]), str(WHEEL / file), "exec")
        exec(code, namespace)  # noqa: S102 - BFCL's own functions, from its wheel
    return namespace


def bfcl_tools(code: dict, functions: list[dict], category: str) -> list[dict]:
    """The tools BFCL's generation sends an OpenAI chat-completions model (Kimi's handler is one): the syntax
    hint `load_dataset_entry` adds, then `convert_to_tool`."""
    hinted = code["_func_doc_language_specific_pre_processing"](copy.deepcopy(functions), category)
    return code["convert_to_tool"](hinted, code["GORILLA_TO_OPENAPI"], code["ModelStyle"].OPENAI_COMPLETIONS)


@pytest.mark.parametrize("category", BFCL_CATEGORIES)
def test_every_record_is_the_wheels_question_with_the_tools_bfcl_sends(category):
    skips = Skips()
    conversations = load(categories=[category], skips=skips)
    records = wheel_records(category)
    assert len(conversations) == len(records) > 0 and not skips.counts
    assert [c.id for c in conversations] == [f"bfcl-{i}" for i in range(len(records))]
    code = bfcl_code()
    for conversation, record in zip(conversations, records):
        assert conversation.messages == [message for turn in record["question"] for message in turn]
        tools = conversation.tools or []
        assert [t["function"]["name"] for t in tools] == [f["name"].replace(".", "_") for f in record["function"]]
        # the same text, key order included: the template writes the tools as JSON
        assert json.dumps(tools) == json.dumps(bfcl_tools(code, record["function"], category)), record["id"]


def test_gorilla_types_become_json_schema_types():
    conversations = load(categories=["simple_python", "multiple"])
    forecast = function(conversations[400 + 5], "weather_get_forecast_by_coordinates")  # multiple_5
    assert forecast["description"].endswith("Note that the provided function is in Python 3 syntax.")
    assert forecast["parameters"]["type"] == "object"  # "dict"
    coordinates = forecast["parameters"]["properties"]["coordinates"]
    assert (coordinates["type"], coordinates["items"]) == ("array", {"type": "number"})  # a tuple of floats
    budget = function(conversations[400 + 8], "realestate_find_properties")["parameters"]["properties"]["budget"]
    note = " This is a float type value."
    assert budget == {"type": "object", "description": "Budget range for the property.", "properties": {
        "min": {"type": "number", "format": "float", "description": "Minimum budget limit." + note},
        "max": {"type": "number", "format": "float", "description": "Maximum budget limit." + note},
    }}
    table = function(conversations[122], "chi_squared_test")["parameters"]["properties"]["table"]
    assert table["items"] == {"type": "array", "items": {"type": "integer"}}


def test_default_categories_are_numbered_across_and_sliced_by_skip_and_limit():
    counts = [len(wheel_records(category)) for category in DEFAULT]
    assert SourceConfig(kind="bfcl").categories == DEFAULT
    everything = load()
    assert len(everything) == sum(counts) and everything[-1].id == f"bfcl-{sum(counts) - 1}"
    sliced = load(skip=counts[0] - 1, limit=2)
    assert [c.id for c in sliced] == [f"bfcl-{counts[0] - 1}", f"bfcl-{counts[0]}"]
    assert sliced[1].messages == wheel_records("multiple")[0]["question"][0]
    assert sources.source_labels([SourceConfig(kind="bfcl"), SourceConfig(kind="bfcl")]) == ["bfcl", "bfcl.2"]


def test_the_tiny_kimi_serves_the_tools_and_trains_the_tool_call_it_answers_with(kimi):
    assert kimi.renders_tools
    conversation = load(categories=["multiple"], skip=8, limit=1)[0]  # two functions, a nested float object
    prompt = kimi.render(conversation.messages, generation_prompt=True, tools=conversation.tools)
    declared = json.dumps(conversation.tools, separators=(",", ":"))
    assert declared in prompt and '"min":{"type":"number"' in declared  # Kimi declares the tools as JSON
    assert kimi.tokenizer.decode(kimi.prompt_ids(conversation.messages, conversation.tools),
                                 skip_special_tokens=False) == prompt

    # regeneration answers with a call: the eval row serves the prompt and holds the call as the answer
    think = "A villa search.</think>" if kimi.template_kwargs["thinking"] else ""
    arguments = '{"location": "San Diego, CA", "propertyType": "villa", "bedrooms": 3}'
    call = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.realestate_find_properties:0"
            f"<|tool_call_argument_begin|>{arguments}<|tool_call_end|><|tool_calls_section_end|>")
    rewrite = Rewrite(conversation)
    assert rewrite.needs_answer()
    rewrite.add_answer(kimi, think + call, finished=True)
    assert not rewrite.needs_answer()
    answered = Conversation(conversation.id, conversation.source, rewrite.messages, tools=conversation.tools)
    [row] = to_rows([answered], kimi, DATA, with_prompt=True, skips=Skips(), split="eval")
    served, answer = (kimi.tokenizer.decode(list(ids), skip_special_tokens=False)
                      for ids in (row["prompt_ids"], row["input_ids"][len(row["prompt_ids"]):]))
    assert (served, answer) == (prompt, think + call + "<|im_end|>")
    assert row["loss_tokens_by_kind"]["tool_call"] > 0


def test_smollm2s_template_has_no_place_for_tools_so_bfcl_prompts_are_skipped(smollm2_dir):
    smollm2 = ChatTemplate(load_tokenizer(smollm2_dir, trust_remote_code=False), {})
    conversation = load(limit=1)[0]
    # its template ignores `tools`: the prompt would ask about functions it never shows
    assert smollm2.render(conversation.messages, True, tools=conversation.tools) == smollm2.render(
        conversation.messages, True)
    assert not smollm2.renders_tools
    with pytest.raises(InvalidConversation, match="tools_unsupported"):
        smollm2.prompt_ids(conversation.messages, conversation.tools)
    skips = Skips()
    assert to_rows([conversation], smollm2, DATA, with_prompt=True, skips=skips, split="eval") == []
    assert skips.as_dict() == {"tools_unsupported": {"count": 1, "first_ids": ["bfcl-0"]}}
    # without tools its prompts are served as before
    plain = Conversation("plain-0", "plain", conversation.messages)
    assert len(to_rows([plain], smollm2, DATA, with_prompt=True, skips=Skips(), split="eval")) == 1


@pytest.mark.parametrize("category", ["multi_turn_base", "simple_java", "no_such_category"])
def test_a_category_not_read_is_a_config_error_listing_those_that_are(tmp_path, category):
    tree = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    tree["data"]["eval_sources"] = [{"kind": "bfcl", "categories": ["simple_python", category]}]
    path = tmp_path / "bfcl.yaml"
    path.write_text(yaml.safe_dump(tree))
    result = run_python("-m", "eagle3_pipeline", "config", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert str(path) in line and "data.eval_sources.0.categories.1" in line and repr(category) in line
    assert all(repr(known) in line for known in BFCL_CATEGORIES), line


def test_malformed_records_are_skipped_by_reason(tmp_path, monkeypatch):
    good = wheel_records("simple_python")[0]
    lines = [json.dumps(good), "{not json", json.dumps(good | {"question": "Hi"}),
             json.dumps(good | {"function": {"name": "f"}}),
             json.dumps(good | {"function": [good["function"][0] | {"parameters": {"type": "dict"}}]}),
             json.dumps(good | {"function": [good["function"][0] | {"parameters": {"type": "dict", "properties": {
                 "x": {"type": "array", "items": "float"}}}}]}),
             json.dumps(good | {"question": [[{"role": "robot", "content": "Hi"}]]}), json.dumps(good)]
    wheel_file = tmp_path / "BFCL_v4_simple_python.json"
    wheel_file.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(sources, "_package_file", lambda kind, package, file: wheel_file)
    skips = Skips()
    conversations = load(categories=["simple_python"], skips=skips)
    assert [c.id for c in conversations] == ["bfcl-0", "bfcl-7"]
    assert skips.as_dict() == {
        "malformed_json": {"count": 1, "first_ids": ["bfcl-1"]},
        "no_messages": {"count": 1, "first_ids": ["bfcl-2"]},
        "malformed_functions": {"count": 3, "first_ids": ["bfcl-3", "bfcl-4", "bfcl-5"]},
        "unknown_role": {"count": 1, "first_ids": ["bfcl-6"]},
    }
    with pytest.raises(InvalidConversation, match="malformed_functions"):
        to_openai(good | {"function": ["f"]})
