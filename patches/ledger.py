"""The ledger: every patch module, in the order its patch is applied, and what happened to each.

Each module listed here holds one `PATCH` (a `patches.patch.Patch`: why, how, upstream, when to remove,
and the function that applies it). `tests/patches/test_ledger_and_plugin.py` fails when a module with a `PATCH` is
missing from this list. Outcomes are per process: vLLM loads the plugin in its engine and in every worker.
"""

from __future__ import annotations

import importlib
import logging
import os

from patches.patch import APPLIED, DISABLED, FAILED, Outcome, Patch, gate

# Comma-separated patch names applied whatever the gate says: to run a patch on a release it was not
# checked against (the tests run the vLLM 0.16 model classes on the installed vLLM this way).
FORCE = "EAGLE3_PATCHES_FORCE"

PATCH_MODULES = (
    # vLLM 0.16/0.17: EAGLE-3 on Kimi-K2.5 (what vLLM 0.18 ships). The model classes come first: the
    # target check only lets through targets that can then serve aux hidden states.
    "patches.vllm_eagle3_deepseek_kimi",
    "patches.vllm_eagle3_target_check",
    # vLLM CPU: extract_hidden_states' connector assumes CUDA.
    "patches.vllm_cpu_hidden_states_connector",
)

_outcomes: dict[str, Outcome] = {}


def all_patches() -> list[Patch]:
    return [importlib.import_module(name).PATCH for name in PATCH_MODULES]


def outcome(name: str) -> Outcome | None:
    return _outcomes.get(name)


def _logger(package: str) -> logging.Logger:
    # Under vLLM's logger, our lines show in vLLM's own log stream (it configures only "vllm.*").
    return logging.getLogger("vllm.eagle3_patches" if package == "vllm" else "eagle3_pipeline.patches")


def apply_package(package: str, enabled: bool = True) -> dict[str, Outcome]:
    """Apply, in ledger order, every patch for `package` not yet tried in this process (re-entrant)."""
    for patch in all_patches():
        if patch.package != package or patch.name in _outcomes:
            continue
        _outcomes[patch.name] = result = _decide_and_apply(patch, enabled)
        log = _logger(package)
        level = logging.WARNING if result.state == FAILED else logging.INFO
        log.log(level, "patch %s: %s (%s)", patch.name, result.state, result.detail)
    return {p.name: _outcomes[p.name] for p in all_patches() if p.package == package}


def _decide_and_apply(patch: Patch, enabled: bool) -> Outcome:
    forced = patch.name in os.environ.get(FORCE, "").split(",")
    decided = None if forced else gate(patch)
    if decided is not None:
        return decided
    if not enabled:
        return Outcome(DISABLED, "needed here, but patches are switched off (EAGLE3_PATCHES=off)")
    try:
        return Outcome(APPLIED, patch.apply() + (f" (forced by {FORCE})" if forced else ""))
    except Exception as error:  # noqa: BLE001 - a broken patch must not take vLLM down: it is reported
        return Outcome(FAILED, f"{type(error).__name__}: {error}")
