"""Finished runs up to 04_train, for the export and validation tests (no vLLM before 06).

- `trained_tiny_run`: fabricate.py's tiny target (hidden 64, vocab 512) and random states, trained 6 steps.
- `trained_stand_in_run`: a stand-in target (SmolLM2 or tiny Kimi), 01 with an eval split carrying
  `prompt_ids` as 06 reads it, 02 from given hidden states, 03, and 04 trained `max_steps` steps.
- `cached_run`: such a run built once into the cache and copied for each test (training takes minutes).
- `demo_run`: the demo's draft on SmolLM2, cached (06's vLLM tests and 01's regeneration with a draft use it).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import yaml

from eagle3_pipeline.capture.store import SampleStates
from eagle3_pipeline.config import RunConfig, parse_config
from eagle3_pipeline.stage_io import MANIFEST, Stage, build_once, file_sha256, fingerprint
from eagle3_pipeline.stand_ins import cache_dir
from eagle3_pipeline.stand_ins.fabricated_stages import write_data_stage, write_states_stage
from eagle3_pipeline.train import loop
from tests.conftest import CONFIGS, ROOT
from tests.train.fabricate import SMOLLM2_AUX_LAYER_IDS, tiny_run, write_vocab_stage
from tests.validate.smollm2_inputs import self_distilled_humaneval


def trained_tiny_run(tmp_path: Path) -> tuple[RunConfig, Path]:
    config, path = tiny_run(tmp_path)
    loop.run(config)
    return config, path


def stand_in_config(tmp_path: Path, name: str, train: dict, validate: dict | None = None,
                    run_dir: Path | None = None, draft: dict | None = None) -> tuple[RunConfig, Path]:
    """configs/<name>.yaml with the given train/validate/draft overrides, written under tmp_path; run_dir
    tmp_path/run."""
    tree = yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())
    tree["run_dir"] = str(run_dir or tmp_path / "run")
    tree["draft"] |= draft or {}
    tree["train"] |= train
    tree["validate"] |= validate or {}
    path = tmp_path / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return parse_config(tree, str(path)), path


def trained_stand_in_run(config: RunConfig, samples: list[dict], states: list[SampleStates], eval_count: int,
                         vocab: int, aux_layer_ids: list[int]) -> None:
    """01 (last `eval_count` samples held out), 02, 03 and 04 of a stand-in target."""
    write_data_stage(config, samples[:-eval_count], samples[-eval_count:], vocab)
    write_states_stage(config, states, aux_layer_ids)
    write_vocab_stage(config)
    loop.run(config)


def source_fingerprint() -> str:
    """A hash of the Python sources that produce a cached run: the package, the patches and the test helpers."""
    files = sorted(path for folder in ("eagle3_pipeline", "patches", "tests") for path in (ROOT / folder).rglob("*.py")
                   if not path.name.startswith("test_"))
    return fingerprint({str(path.relative_to(ROOT)): file_sha256(path) for path in files})


def cached_run(tmp_path: Path, key: str, config_name: str, train: dict, validate: dict,
               build: Callable[[RunConfig], None]) -> tuple[RunConfig, Path]:
    """A run finished up to 04, built once by `build(config)` into the cache, copied under tmp_path.

    The copy is a complete run: stage fingerprints cover config sections, never run_dir, and every manifest
    travels with the folder it describes. The cache folder is keyed on the stages' fingerprints and on the
    code that builds the run (`source_fingerprint`), so a changed config or a changed stage, training or
    fabricating code builds afresh. Bump the version inside `key` when `build` depends on anything else.
    """
    config, _ = stand_in_config(tmp_path / "key", config_name, train, validate)
    built = ("01_data", "02_hidden_states", "03_vocab", "04_train")
    stages = fingerprint([Stage(config, name).fingerprint for name in built] + [source_fingerprint()])
    cached = cache_dir() / "test_runs" / f"{key}-{stages}"
    build_once(cached, (cached / "04_train" / MANIFEST).exists,
               lambda building: build(stand_in_config(tmp_path / "build", config_name, train, validate,
                                                      run_dir=building)[0]))
    shutil.copytree(cached, tmp_path / "run")
    return stand_in_config(tmp_path, config_name, train, validate)


# The demo's draft shape, trained on SmolLM2's own answers to 152 HumanEval prompts (160 steps; about 3 minutes
# on 2 idle cores, once: the finished run is cached), served on the 12 held-out ones.
DEMO_SAMPLES, DEMO_HELD_OUT = 164, 12
DEMO_TRAIN = {"max_steps": 160, "warmup_steps": 4, "eval_every": 80, "checkpoint_every": 160, "log_every": 8}
DEMO_VALIDATE = {"max_prompts": DEMO_HELD_OUT, "max_tokens": 48}


def build_demo_run(config) -> None:
    from eagle3_pipeline.stand_ins import ensure_stand_in

    samples, states = self_distilled_humaneval(ensure_stand_in("smollm2-135m-instruct"), DEMO_SAMPLES, 96)
    trained_stand_in_run(config, samples, states, eval_count=DEMO_HELD_OUT, vocab=49152,
                         aux_layer_ids=SMOLLM2_AUX_LAYER_IDS)


def demo_run(tmp_path: Path) -> tuple[RunConfig, Path]:
    """The demo draft's run through 04 (configs/demo.yaml with DEMO_TRAIN / DEMO_VALIDATE), under tmp_path/run."""
    return cached_run(tmp_path, "smollm2-demo-draft-v1", "demo", DEMO_TRAIN, DEMO_VALIDATE, build_demo_run)
