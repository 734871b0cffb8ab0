"""Shared fixtures: configs, the run config of a toy run, stand-in targets from the cache."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_pipeline.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"


@pytest.fixture
def demo_config(tmp_path: Path) -> RunConfig:
    """configs/demo.yaml with run_dir moved into the test's temporary folder."""
    return load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path / 'run'}"])


def run_python(*args: str, cwd: Path = ROOT, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run `python ARGS` the way a user would, capturing its output."""
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from eagle3_pipeline.stand_ins import ensure_stand_in

    return ensure_stand_in("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_kimi_dir() -> Path:
    from eagle3_pipeline.stand_ins import ensure_stand_in

    return ensure_stand_in("tiny-kimi-k25")
