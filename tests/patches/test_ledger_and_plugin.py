"""The ledger lists every patch; the plugin is installed, gated, re-entrant, switchable; `require_applied` checks."""

from __future__ import annotations

import importlib
import os
import pkgutil
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

import patches
from patches import PLUGIN_NAME, PatchError, ledger, require_applied
from patches.patch import APPLIED, DISABLED, FAILED, NOT_NEEDED, Patch, installed_version
from tests.conftest import ROOT

VLLM_016_ONLY = ("vllm-eagle3-deepseek-kimi", "vllm-eagle3-target-check")


def test_every_patch_module_is_in_the_ledger():
    modules = {f"patches.{m.name}" for m in pkgutil.iter_modules(patches.__path__) if not m.ispkg}
    with_a_patch = {name for name in modules if hasattr(importlib.import_module(name), "PATCH")}
    assert with_a_patch == set(ledger.PATCH_MODULES)
    names = [patch.name for patch in ledger.all_patches()]
    assert len(names) == len(set(names))
    for patch in ledger.all_patches():
        assert all(getattr(patch, field).strip() for field in ("why", "how", "upstream", "remove_when")), patch.name
        assert SpecifierSet(patch.versions) and SpecifierSet(patch.affected)


def test_the_plugin_is_an_installed_vllm_entry_point():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get(PLUGIN_NAME) == "patches.plugin:register", "run: pip install --no-deps -e ."


def run_python(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})


def listing(**env: str) -> dict[str, str]:
    """`python -m patches` in a fresh process: patch name -> its state line."""
    result = run_python("-m", "patches", **env)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    return {line.split()[0]: lines[i + 1].strip() for i, line in enumerate(lines) if line and not line[0].isspace()}


@pytest.fixture(scope="module")
def shown() -> dict[str, str]:
    return listing()


def expected_states() -> dict[str, str]:
    """What each patch must report in the environment `make setup` builds: vLLM >= 0.18 (the 0.16 backports are
    not needed) and the CPU connector fix on a machine without an accelerator only."""
    import torch

    assert installed_version("vllm") >= Version("0.18"), "the tests run in `make setup`'s environment (vLLM >= 0.18)"
    return {**dict.fromkeys(VLLM_016_ONLY, NOT_NEEDED),
            "vllm-cpu-hidden-states-connector": NOT_NEEDED if torch.cuda.is_available() else APPLIED}


def test_listing_shows_every_patch_with_its_expected_state(shown):
    assert {name: state.split(":")[0] for name, state in shown.items()} == expected_states()


def test_off_switch_disables_what_would_apply(shown):
    after = listing(EAGLE3_PATCHES="off")
    for name, state in shown.items():
        expected = DISABLED if state.startswith(APPLIED) else state.split(":")[0]
        assert after[name].startswith(expected), (name, after[name])


# ------------------------------------------------------------------------------- gate and re-entrancy
def fake(name="fake", affected=">=1.0,<3.0", versions=">=1.0,<2.0", apply=lambda: "did it", **kwargs) -> Patch:
    return Patch(name=name, package="fakepkg", affected=affected, versions=versions, why="w", how="h", upstream="u",
                 remove_when="r", apply=apply, **kwargs)


@pytest.mark.parametrize("version, state", [(None, NOT_NEEDED), ("0.9", NOT_NEEDED), ("1.5", APPLIED),
                                            ("1.5.post1+cpu", APPLIED), ("2.5", FAILED), ("3.0", NOT_NEEDED)])
def test_gate(monkeypatch, version, state):
    monkeypatch.setattr("patches.patch.installed_version", lambda package: version and Version(version))
    assert ledger._decide_and_apply(fake(), enabled=True).state == state


def test_platform_condition_and_failures_are_reported_not_raised(monkeypatch):
    monkeypatch.setattr("patches.patch.installed_version", lambda package: Version("1.5"))
    assert ledger._decide_and_apply(fake(not_needed_here=lambda: "not here"), True).state == NOT_NEEDED
    assert ledger._decide_and_apply(fake(), enabled=False).state == DISABLED

    def broken():
        raise KeyError("anchor gone")

    result = ledger._decide_and_apply(fake(apply=broken), True)
    assert result.state == FAILED and "anchor gone" in result.detail


def test_apply_package_is_reentrant(monkeypatch):
    calls = []
    monkeypatch.setattr("patches.patch.installed_version", lambda package: Version("1.5"))
    monkeypatch.setattr(ledger, "all_patches", lambda: [fake(apply=lambda: calls.append(1) or "done")])
    monkeypatch.setattr(ledger, "_outcomes", {})
    first = ledger.apply_package("fakepkg")
    assert ledger.apply_package("fakepkg") == first and first["fake"].state == APPLIED
    assert calls == [1]


# --------------------------------------------------------------------------------------- require_applied
def test_require_applied_names_unknown_patches():
    with pytest.raises(PatchError, match="unknown patch"):
        require_applied("no-such-patch")


REQUIRE = "import patches; patches.require_applied({names}); print('required ok')"


def test_require_applied_goes_through_vllms_plugin_loader():
    names = ", ".join(repr(name) for name in VLLM_016_ONLY)
    on = run_python("-c", REQUIRE.format(names=names))
    assert on.returncode == 0 and "required ok" in on.stdout, on.stderr[-2000:]
    off = run_python("-c", REQUIRE.format(names=names), VLLM_PLUGINS="some_other_plugin")
    assert off.returncode != 0 and "VLLM_PLUGINS" in off.stderr, off.stderr[-2000:]
