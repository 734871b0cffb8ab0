"""Environments for the scripts a test starts: `python_environment(folder, ...)` writes a `sitecustomize.py` into
`folder` and returns an environment with `folder` first on PYTHONPATH, so that every Python process started with
it (vLLM's engine processes included) runs that file first.

- `no_speculators`: a meta-path finder refuses `speculators` and its submodules, as in docs/vllm016.md's
  environment (vLLM 0.16 needs transformers<5, speculators 0.9 needs >=5, so that environment has none).
- `reads_dir`: each script records the config keys it reads into `reads_dir` (tests/read_recorder.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from tests.conftest import ROOT

REFUSAL = "speculators is not installed in this environment (vLLM 0.16's has none)"
NO_SPECULATORS = f'''import sys


class NoSpeculators:
    def find_spec(self, name, path=None, target=None):
        if name == "speculators" or name.startswith("speculators."):
            raise ModuleNotFoundError("{REFUSAL}", name=name)
        return None


sys.meta_path.insert(0, NoSpeculators())
'''
RECORD_READS = '''
from tests.read_recorder import install

install({folder!r})
'''


def python_environment(folder: Path, no_speculators: bool = False, reads_dir: Path | None = None) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    parts = ([NO_SPECULATORS] if no_speculators else []) + ([RECORD_READS.format(folder=str(reads_dir))] if reads_dir else [])
    (folder / "sitecustomize.py").write_text("\n".join(parts))
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), str(ROOT), environment.get("PYTHONPATH")]))
    return environment


def without_speculators(folder: Path) -> dict[str, str]:
    return python_environment(folder, no_speculators=True)
