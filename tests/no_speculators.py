"""A Python environment where `import speculators` fails, as in docs/vllm016.md's environment (vLLM 0.16 needs
transformers<5, speculators 0.9 needs >=5, so that environment has no speculators).

`without_speculators(folder)` writes a `sitecustomize.py` into `folder` that puts a meta-path finder first,
refusing `speculators` and its submodules, and returns an environment with `folder` first on PYTHONPATH: every
Python process started with it (vLLM's engine processes included) runs without speculators.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import ROOT

REFUSAL = "speculators is not installed in this environment (vLLM 0.16's has none)"
SITECUSTOMIZE = f'''import sys


class NoSpeculators:
    def find_spec(self, name, path=None, target=None):
        if name == "speculators" or name.startswith("speculators."):
            raise ModuleNotFoundError("{REFUSAL}", name=name)
        return None


sys.meta_path.insert(0, NoSpeculators())
'''


def without_speculators(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), str(ROOT), environment.get("PYTHONPATH")]))
    return environment
