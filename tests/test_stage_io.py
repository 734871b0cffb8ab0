"""The stage contract, through toy stages run as a user runs the numbered scripts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eagle3_pipeline.config import load_config
from eagle3_pipeline.stage_io import MANIFEST, STAGES, Stage, StageError, atomic_path, read_manifest
from tests.conftest import CONFIGS, run_python


def toy(tmp_path: Path, stage: str, *extra: str):
    return run_python(
        "-m", "tests.toy_stages", "--stage", stage, "--config", str(CONFIGS / "demo.yaml"),
        "--set", f"run_dir={tmp_path / 'run'}", *extra, timeout=120,
    )


def manifest(tmp_path: Path, stage: str) -> dict:
    return read_manifest(tmp_path / "run" / stage)


def test_complete_stage_reruns_as_a_no_op_and_force_redoes_it(tmp_path):
    first = toy(tmp_path, "01_data")
    assert first.returncode == 0, first.stderr
    written = manifest(tmp_path, "01_data")
    assert written["counts"] == {"numbers": 1024}
    assert written["config"]["data"]["max_seq_len"] == 1024 and "torch" in written["versions"]
    assert set(written["timings_s"]) >= {"total"}

    again = toy(tmp_path, "01_data")
    assert again.returncode == 0 and "already complete" in again.stdout and "nothing to do" in again.stdout
    assert manifest(tmp_path, "01_data") == written  # untouched

    forced = toy(tmp_path, "01_data", "--force")
    assert forced.returncode == 0 and "already complete" not in forced.stdout
    assert manifest(tmp_path, "01_data")["finished_at"] >= written["finished_at"]
    assert manifest(tmp_path, "01_data")["argv"][-1] == "--force"


def test_missing_input_is_refused_naming_the_stage_to_run(tmp_path):
    result = toy(tmp_path, "03_vocab")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: 03_vocab needs 01_data, which is missing or incomplete: "
        "rerun `python 01_prepare_data.py --config <config>`"
    ]


def test_input_made_under_another_config_is_refused(tmp_path):
    assert toy(tmp_path, "01_data").returncode == 0
    stale = toy(tmp_path, "03_vocab", "--set", "data.max_seq_len=99")
    assert stale.returncode == 1
    assert stale.stderr.strip().splitlines() == [
        "error: 01_data was produced under a different config (changed: data.max_seq_len: 1024 -> 99): rerun "
        "`python 01_prepare_data.py --config <config>` --force, then the stages after it"]
    assert not (tmp_path / "run" / "03_vocab" / MANIFEST).exists()


def test_stage_older_than_its_redone_input_is_refused(tmp_path):
    assert toy(tmp_path, "01_data").returncode == 0
    assert toy(tmp_path, "03_vocab").returncode == 0
    assert toy(tmp_path, "01_data", "--force").returncode == 0
    rerun = toy(tmp_path, "03_vocab")
    assert rerun.returncode == 1 and "older than its inputs" in rerun.stderr
    assert toy(tmp_path, "03_vocab", "--force").returncode == 0


def test_a_finished_stage_is_stale_once_an_earlier_stages_config_changes(tmp_path):
    """03 does not fingerprint `data`, but its input does: 03 is no longer complete, and says which stage to redo."""
    assert toy(tmp_path, "01_data").returncode == 0
    assert toy(tmp_path, "03_vocab").returncode == 0
    stale = toy(tmp_path, "03_vocab", "--set", "data.max_seq_len=99")
    assert stale.returncode == 1 and "already complete" not in stale.stdout
    assert "01_data was produced under a different config (changed: data.max_seq_len: 1024 -> 99)" in stale.stderr


def test_changed_config_does_not_overwrite_a_finished_stage_without_force(tmp_path):
    assert toy(tmp_path, "01_data").returncode == 0
    before = manifest(tmp_path, "01_data")
    changed = toy(tmp_path, "01_data", "--set", "data.max_seq_len=50")
    assert changed.returncode == 1 and "--force" in changed.stderr
    assert manifest(tmp_path, "01_data") == before


def test_killed_stage_leaves_nothing_readable_and_reruns_cleanly(tmp_path):
    killed = toy(tmp_path, "01_data", "--die-midway")
    assert killed.returncode == -9
    stage_dir = tmp_path / "run" / "01_data"
    assert not (stage_dir / "numbers.json").exists() and not (stage_dir / MANIFEST).exists()
    refused = toy(tmp_path, "03_vocab")
    assert refused.returncode == 1 and "missing or incomplete" in refused.stderr

    resumed = toy(tmp_path, "01_data")
    assert resumed.returncode == 0 and "resuming partial work" in resumed.stdout
    assert len(json.loads((stage_dir / "numbers.json").read_text())) == 1024
    # Partial work left under another config is not mixed into a new run.
    assert toy(tmp_path, "01_data", "--die-midway", "--force").returncode == -9
    other = toy(tmp_path, "01_data", "--set", "data.max_seq_len=50")
    assert other.returncode == 1 and "partial work under a different config" in other.stderr


def test_atomic_path_publishes_only_on_success(tmp_path):
    target = tmp_path / "out.bin"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole"


def test_every_stage_reads_only_earlier_stages():
    order = list(STAGES)
    assert order == sorted(order)
    for position, spec in enumerate(STAGES.values()):
        assert all(order.index(name) < position for name in spec.inputs), spec.name


def test_a_stage_named_on_single_keys_ignores_the_rest_of_their_section(tmp_path):
    """03 reads only draft.draft_vocab_size of the draft section: a norm option changes 04, not 03."""
    def fingerprints(*overrides):
        config = load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path}", *overrides])
        return Stage(config, "03_vocab").fingerprint, Stage(config, "04_train").fingerprint

    base, norm_option, vocab = fingerprints(), fingerprints("draft.norm_output=true"), \
        fingerprints("draft.draft_vocab_size=2048")
    assert norm_option[0] == base[0] and norm_option[1] != base[1]
    assert vocab[0] != base[0] and vocab[1] != base[1]


def test_a_deleted_earlier_folder_is_not_needed_but_its_config_still_counts(tmp_path):
    """05 reads 04 and 01: with 02's states and 03's vocab deleted (disk freed after training) it still starts, and
    a changed key of 02 still makes it stale, through the config 04's manifest records."""
    config = load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path}"])
    for name in ("01_data", "02_hidden_states", "03_vocab", "04_train"):
        stage = Stage(config, name)
        stage.begin()
        stage.finish()
    for name in ("02_hidden_states", "03_vocab"):
        shutil.rmtree(tmp_path / name)
    assert set(Stage(config, "05_export").check_inputs()) == {"04_train", "01_data"}
    changed = load_config(CONFIGS / "demo.yaml", [f"run_dir={tmp_path}", "capture.dtype=fp8"])
    with pytest.raises(StageError, match=r"04_train was made from 02_hidden_states under a different config "
                                         r"\(changed: capture.dtype: \"bfloat16\" -> \"fp8\"\)"):
        Stage(changed, "05_export").check_inputs()


def test_a_build_waits_for_another_process_building_the_same_thing(tmp_path):
    import multiprocessing
    import time

    from eagle3_pipeline.stage_io import build_lock

    final = tmp_path / "built"
    context = multiprocessing.get_context("spawn")
    holding = context.Event()
    other = context.Process(target=_hold_build_lock, args=(str(final), holding, 1.5))
    other.start()
    assert holding.wait(60)
    started = time.monotonic()
    with build_lock(final):
        waited = time.monotonic() - started
    other.join()
    assert waited >= 1.0 and final.read_text() == "built by the other process"


def _hold_build_lock(final: str, holding, seconds: float) -> None:
    import time
    from pathlib import Path

    from eagle3_pipeline.stage_io import build_lock

    with build_lock(Path(final)):
        holding.set()
        time.sleep(seconds)
        Path(final).write_text("built by the other process")
