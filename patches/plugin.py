"""The vLLM general plugin: entry point `eagle3_pipeline_patches` of group `vllm.general_plugins`.

vLLM calls `register()` in every process it starts (engine core, each worker) and may call it more than
once in one process: patches already tried in this process are skipped.
"""

from __future__ import annotations

import logging

from patches import enabled
from patches.ledger import apply_package
from patches.patch import installed_version

log = logging.getLogger("vllm.eagle3_patches")


def register() -> None:
    # 1. The off switch is honoured inside apply_package: needed patches then report "disabled".
    # 2. The version check: each patch's gate compares this version with the releases it was checked on.
    version = installed_version("vllm")
    if version is None:
        log.warning("eagle3 patches: cannot read the installed vLLM version; no patch applied")
        return
    # 3. One ordered list of applications (patches.ledger.PATCH_MODULES), each logging what it replaced.
    apply_package("vllm", enabled=enabled())
