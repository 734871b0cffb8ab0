"""The engine settings the stages start vLLM with."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import sys
import types

import pytest

from eagle3_pipeline import engine
from eagle3_pipeline.config import ConfigError
from eagle3_pipeline.config_sections import TargetConfig
from eagle3_pipeline.export import serving

EAGLE3 = {"method": "eagle3", "model": "/exports/reference", "num_speculative_tokens": 3}


def test_cpu_engine_settings_carry_the_kv_cache_reserved_cores_and_mla_switch(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"kv_lora_rank": 16}}))
    target = TargetConfig(path=str(tmp_path), engine={"cpu_reserved_cores": 0})
    monkeypatch.setattr(engine, "on_cpu", lambda: True)
    settings, environment = engine.engine_settings(target, tmp_path, speculative_config=EAGLE3)
    assert settings["kv_cache_memory_bytes"] == engine.CPU_KV_CACHE_BYTES and settings["speculative_config"] == EAGLE3
    assert environment == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_MLA_DISABLE": "1"}
    # without a draft the MLA target keeps its MLA attention; on a GPU none of the CPU settings apply
    assert engine.engine_settings(target, tmp_path)[1] == {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    monkeypatch.setattr(engine, "on_cpu", lambda: False)
    monkeypatch.setattr(engine, "mrv2_plans_the_drafts_own_attention", lambda: True)
    settings, environment = engine.engine_settings(target, tmp_path, speculative_config=EAGLE3)
    assert "kv_cache_memory_bytes" not in settings and environment == {}


def test_gpu_engine_runs_an_mla_target_with_a_draft_on_v1_and_takes_an_explicit_kv_cache(monkeypatch, tmp_path):
    """MRv2 plans the draft's FlashAttention with the MLA target's shape: the eagle3 engine of an MLA target
    selects V1; a dense target, or an MLA target without a draft, keeps vLLM's own choice."""
    monkeypatch.setattr(engine, "on_cpu", lambda: False)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.26.0")
    mla, dense = tmp_path / "mla", tmp_path / "dense"
    for folder, text in ((mla, {"kv_lora_rank": 16}), (dense, {"num_key_value_heads": 3})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"text_config": text}))
    target = TargetConfig(path=str(mla), engine={"kv_cache_memory_gb": 1.5})
    settings, environment = engine.engine_settings(target, mla, speculative_config=EAGLE3)
    assert environment == {"VLLM_USE_V2_MODEL_RUNNER": "0"} and settings["kv_cache_memory_bytes"] == 3 * 2**29
    assert engine.engine_settings(target, mla)[1] == {}
    assert engine.engine_settings(target, dense, speculative_config=EAGLE3)[1] == {}
    assert shlex.split(serving.server_command(settings, environment))[0] == "VLLM_USE_V2_MODEL_RUNNER=0"
    # vLLM 0.33 plans the draft's attention from the draft's own layers: vLLM's own runner choice stands
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.33.0")
    assert engine.engine_settings(target, mla, speculative_config=EAGLE3)[1] == {}


def test_an_mla_draft_shares_an_mla_targets_attention_and_is_refused_beside_a_dense_one(monkeypatch, tmp_path):
    """An MLA draft (draft.attention mla) on an MLA target needs neither VLLM_MLA_DISABLE (CPU) nor V1 (GPU):
    both use the same MLA backend. vLLM cannot pair an MLA draft with a dense target (CPU: KV block sizes; GPU:
    the MLA prefill backend is picked by the target's head dims): refused before load."""
    mla, dense, draft = tmp_path / "mla", tmp_path / "dense", tmp_path / "draft"
    for folder, config in ((mla, {"text_config": {"kv_lora_rank": 16}}), (dense, {"num_key_value_heads": 3}),
                           (draft, {"model_type": "deepseek_v2", "kv_lora_rank": 512})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    mla_draft = {**EAGLE3, "model": str(draft)}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.26.0")
    for cpu in (True, False):
        monkeypatch.setattr(engine, "on_cpu", lambda cpu=cpu: cpu)
        environment = engine.engine_settings(TargetConfig(path=str(mla)), mla, speculative_config=mla_draft)[1]
        assert "VLLM_MLA_DISABLE" not in environment and "VLLM_USE_V2_MODEL_RUNNER" not in environment
    assert engine.serves_mla_draft({"speculative_config": mla_draft})
    assert not engine.serves_mla_draft({"speculative_config": EAGLE3}) and not engine.serves_mla_draft({})
    monkeypatch.setitem(sys.modules, "vllm", None)  # refused before vLLM is imported
    for cpu, reason in ((True, "KV blocks"), (False, "prefill backend by the target's MLA head dims")):
        monkeypatch.setattr(engine, "on_cpu", lambda cpu=cpu: cpu)
        with pytest.raises(ConfigError, match=f"serves an MLA draft .* only on an MLA target: .*{reason}"):
            engine.start_engine(TargetConfig(path=str(dense)), dense, speculative_config=mla_draft)


def test_an_engines_environment_is_set_while_it_starts_and_restored_after(monkeypatch, tmp_path):
    """VLLM_MLA_DISABLE for 06's engine with the draft must not reach its engine without speculation."""
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"kv_lora_rank": 16}}))
    target = TargetConfig(path=str(tmp_path), engine={"cpu_reserved_cores": 0})
    monkeypatch.setattr(engine, "on_cpu", lambda: True)
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # the caller's own value comes back
    monkeypatch.delenv("VLLM_MLA_DISABLE", raising=False)
    seen = []

    class FakeLLM:  # records the environment the engine's processes would inherit
        def __init__(self, **settings):
            seen.append({name: os.environ.get(name) for name in ("VLLM_MLA_DISABLE", "VLLM_CPU_NUM_OF_RESERVED_CPU")})

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    engine.start_engine(target, tmp_path, speculative_config=EAGLE3)
    assert os.environ.get("VLLM_MLA_DISABLE") is None and os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    engine.start_engine(target, tmp_path)
    assert seen == [{"VLLM_MLA_DISABLE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                    {"VLLM_MLA_DISABLE": None, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}]
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def test_cpu_engine_runs_an_fp32_mla_target_on_the_reference_mla_backend(monkeypatch, tmp_path):
    """vLLM CPU's AMX MLA backend packs bf16/fp16/int8 weights only: an fp32 MLA target asks for CPU_MLA."""
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"kv_lora_rank": 16}}))
    monkeypatch.setattr(engine, "on_cpu", lambda: True)
    fp32, bf16 = (TargetConfig(path=str(tmp_path), engine={"dtype": dtype}) for dtype in ("float32", "bfloat16"))
    assert engine.engine_settings(fp32, tmp_path)[0]["attention_backend"] == "CPU_MLA"
    assert "attention_backend" not in engine.engine_settings(bf16, tmp_path)[0]
    assert engine.engine_settings(bf16, tmp_path, dtype="float32")[0]["attention_backend"] == "CPU_MLA"
    # with a draft the target's MLA is off (VLLM_MLA_DISABLE): no MLA backend to choose
    assert "attention_backend" not in engine.engine_settings(fp32, tmp_path, speculative_config=EAGLE3)[0]


def test_gpu_engine_refuses_an_fp32_mla_target_before_loading_and_takes_fp16(monkeypatch, tmp_path):
    """vLLM 0.26's CUDA MLA backends take float16 and bfloat16 only: an fp32 MLA engine on a GPU (06's
    validate.engine_dtype) is a config error before vLLM starts; float16, a dense target or the CPU start."""
    mla, dense = tmp_path / "mla", tmp_path / "dense"
    for folder, text in ((mla, {"kv_lora_rank": 16}), (dense, {"num_key_value_heads": 3})):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"text_config": text}))
    loaded = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **settings: loaded.append(settings)))
    monkeypatch.setattr(engine, "on_cpu", lambda: False)
    target = TargetConfig(path=str(mla))
    with pytest.raises(ConfigError, match="dtype float32 .* on an MLA target: vLLM GPU has no float32 MLA"):
        engine.start_engine(target, mla, dtype="float32")
    assert loaded == []
    engine.start_engine(target, mla, dtype="float16")
    engine.start_engine(TargetConfig(path=str(dense)), dense, dtype="float32")
    monkeypatch.setattr(engine, "on_cpu", lambda: True)
    engine.start_engine(target, mla, dtype="float32")
    assert [settings["dtype"] for settings in loaded] == ["float16", "float32", "float32"]


def test_vllm_034_without_model_runner_v1_refuses_the_v1_switch_before_loading(monkeypatch, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    target = TargetConfig(path=str(tmp_path))
    monkeypatch.setattr(engine, "on_cpu", lambda: True)
    loaded = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **settings: loaded.append(settings)))
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.34.0")
    with pytest.raises(ConfigError, match="VLLM_USE_V2_MODEL_RUNNER=0: vLLM 0.34 has no Model Runner V1"):
        engine.start_engine(target, tmp_path)
    assert loaded == []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.33.1")  # V1 still there: allowed
    engine.start_engine(target, tmp_path)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")  # redundant on 0.34, not refused
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.34.0")
    engine.start_engine(target, tmp_path)
    assert len(loaded) == 2


def test_without_vllm_here_the_command_is_the_newest_releases_and_a_note_names_0_29_to_0_32(monkeypatch, tmp_path):
    """05 in a training environment (no vLLM) cannot know the serving release: the command carries no
    VLLM_USE_V2_MODEL_RUNNER (0.34 refuses 0) and a note beside it names the releases that need V1."""
    from eagle3_pipeline.config import load_config

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(engine, "on_cpu", lambda: False)
    monkeypatch.setattr(serving, "on_cpu", lambda: False)
    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"kv_lora_rank": 16}}))
    assert engine.installed_vllm() is None
    target = TargetConfig(path=str(tmp_path))
    assert engine.engine_settings(target, tmp_path, speculative_config=EAGLE3)[1] == {}
    config = load_config("configs/demo.yaml", ["target.stand_in=null", f"target.path={tmp_path}"])
    assert not serving.serving_command(config, tmp_path / "export").startswith("VLLM_USE_V2_MODEL_RUNNER")
    assert serving.serving_note(config, tmp_path / "export") == serving.OLDER_RUNNER_NOTE
    # the CPU build's distribution name is vLLM too: below 0.33 it takes V1 for a Llama draft on an MLA target
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "0.32.0" if name == "vllm-cpu" else not_installed(name))
    assert engine.installed_vllm() == (0, 32)
    assert engine.engine_settings(target, tmp_path, speculative_config=EAGLE3)[1] == {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    assert serving.serving_note(config, tmp_path / "export") is None  # the command itself carries it


def test_a_text_only_engine_starts_without_the_targets_encoders_where_vllm_can(monkeypatch, tmp_path):
    """start_engine's `text_only` reaches vLLM as `language_model_only` (the installed vLLM has it), and only then."""
    from vllm.engine.arg_utils import EngineArgs

    assert "language_model_only" in EngineArgs.__dataclass_fields__
    (tmp_path / "config.json").write_text(json.dumps({"num_key_value_heads": 3}))
    seen = []

    class FakeLLM:
        def __init__(self, **settings):
            seen.append(settings.get("language_model_only"))

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=FakeLLM))
    for text_only in (True, False):
        engine.start_engine(TargetConfig(path=str(tmp_path)), tmp_path, text_only=text_only)
    assert seen == [True, None]
