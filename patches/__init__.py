"""Compatibility patches: the pipeline on vLLM 0.16 (Kimi-K2.5 EAGLE-3 and capture) and vLLM on CPU.

Every patch is one module holding a `PATCH` ledger entry (why, how, upstream, when to remove) and the
function that applies it; `patches.ledger.PATCH_MODULES` lists them in application order. Patches change
vLLM only through its extension points: the `vllm.general_plugins` entry point `patches.plugin:register`
(loaded by vLLM in every engine and worker process), `ModelRegistry.register_model` and
`KVConnectorFactory.register_connector` for subclasses, and a wrapped config validator.

- `python -m patches` lists every patch with its state here (applied, not needed, failed, disabled);
  `-v` adds the ledger text.
- `EAGLE3_PATCHES=off` switches them all off (they then report "disabled" where they would apply);
  `EAGLE3_PATCHES_FORCE=name,...` applies the named ones whatever their version gate says.
- `require_applied(name, ...)` is the check a stage calls before it relies on a patch: vLLM only logs a
  plugin that fails to import and runs on without it.
"""

from __future__ import annotations

import os

from patches.ledger import all_patches, outcome
from patches.patch import APPLIED, NOT_NEEDED

OFF_SWITCH = "EAGLE3_PATCHES"
PLUGIN_NAME = "eagle3_pipeline_patches"  # the entry point's name, as VLLM_PLUGINS would list it


class PatchError(RuntimeError):
    """A patch that a stage relies on is not in effect in this process."""


def enabled() -> bool:
    return os.environ.get(OFF_SWITCH, "on").strip().lower() not in ("0", "off", "false", "no")


def require_applied(*names: str) -> None:
    """Raise `PatchError` unless every named patch is applied, or not needed, in this process.

    A patch not yet tried here is loaded the way vLLM loads it (through its plugin loader), so this also
    proves the entry point is installed and allowed by VLLM_PLUGINS.
    """
    known = [patch.name for patch in all_patches()]
    for name in names:
        if name not in known:
            raise PatchError(f"unknown patch {name!r}; the ledger has: {', '.join(known)}")
        if outcome(name) is None:
            from vllm.plugins import load_general_plugins

            load_general_plugins()
        result = outcome(name)
        if result is None:
            raise PatchError(
                f"patch {name}: vLLM did not load the plugin {PLUGIN_NAME!r}. Install the project "
                f"(pip install -e .) in this environment and leave VLLM_PLUGINS unset (or include {PLUGIN_NAME})"
            )
        if result.state not in (APPLIED, NOT_NEEDED):
            raise PatchError(f"patch {name} is {result.state}: {result.detail}")
