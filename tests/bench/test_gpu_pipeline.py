"""bench.gpu_pipeline refuses to start where the project's vLLM plugin is not installed, and runs a job's stages
as a user would (stand-in scripts here, no GPU): in order until one fails, from another job's earlier stages."""

import importlib.metadata
import json
import sys

import pytest

from bench import gpu_pipeline
from bench.gpu_pipeline import ALL, Job, run_job

STAGE = """import json, os, pathlib, sys
run_dir = pathlib.Path(next(a for a in sys.argv if a.startswith("run_dir=")).split("=", 1)[1])
stage = run_dir / pathlib.Path(sys.argv[0]).stem
stage.mkdir(parents=True, exist_ok=True)
(stage / "manifest.json").write_text(json.dumps({"counts": {"ran": True}, "other": 1}))
print("stage", stage.name, "ran")
sys.exit(1 if stage.name == os.environ.get("FAIL") else 0)
"""


def test_the_plugin_is_found_where_the_project_is_installed():
    assert gpu_pipeline.plugin_installed()


def test_a_node_without_the_plugin_is_refused_before_any_job(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    monkeypatch.setattr(sys, "argv", ["gpu_pipeline", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    with pytest.raises(SystemExit, match="eagle3_pipeline_patches.*is not installed"):
        gpu_pipeline.main()
    assert not (tmp_path / "out").exists()


def test_jobs_run_their_stages_in_order_until_one_fails(monkeypatch, tmp_path):
    scripts = {}
    for name in ALL:  # each stage a script named after it that leaves a manifest
        scripts[name] = str(tmp_path / f"{name}.py")
        (tmp_path / f"{name}.py").write_text(STAGE)
    monkeypatch.setattr(gpu_pipeline, "SCRIPTS", scripts)
    out, work, results = tmp_path / "out", tmp_path / "work", {}
    out.mkdir()
    run_job(Job("first", "c.yaml", ALL[:5], ["x=$WORK/y"], {"FAIL": "04_train"}), out, work, results)
    stages = results["first"]["stages"]
    assert list(stages) == list(ALL[:4])  # 05 never ran after 04 failed
    assert [stage["exit"] for stage in stages.values()] == [0, 0, 0, 1]
    assert results["first"]["hf_check"]["passed"] is False  # 02's states checked (here: no such config)
    assert stages["01_data"]["command"].startswith("FAIL=04_train python ")
    assert "--set x=$WORK/y --set run_dir=$WORK/first" in stages["01_data"]["command"]
    assert stages["03_vocab"]["tail"][-1] == "stage 03_vocab ran" and stages["03_vocab"]["manifest"] == {
        "counts": {"ran": True}}
    run_job(Job("second", "c.yaml", ALL[3:4], copy_from="first"), out, work, results)
    assert (work / "second" / "03_vocab" / "manifest.json").exists() and results["second"]["stages"]["04_train"]
    run_job(Job("third", "c.yaml", ALL[5:], copy_from="first"), out, work, results)  # first has no 05
    assert results["third"]["skipped"] == "first failed before its 05_export" and not (work / "third" / ALL[5]).exists()
    run_job(Job("bench", "c.yaml", bench=["-c", "print('$OUT')"]), out, work, results)
    assert results["bench"]["exit"] == 0 and results["bench"]["command"] == "python -c print('$OUT')"
    assert json.loads((out / "gpu_pipeline.json").read_text()) == results


def test_set_adds_overrides_to_every_stage_job_after_its_own(monkeypatch, tmp_path):
    """`--set` reaches each chosen stage job's stages (the learned Kimi's bf16 and float16 06 on one build here),
    after the job's own overrides; a bench job (the stand-in's build) and the job table stay as they were."""
    ran = []
    monkeypatch.setattr(gpu_pipeline, "plugin_installed", lambda: True)
    monkeypatch.setattr(gpu_pipeline.torch.cuda, "get_device_name", lambda index: "a GPU")
    monkeypatch.setattr(gpu_pipeline, "run_job", lambda job, out, work, results: ran.append(job))
    monkeypatch.setattr(sys, "argv", ["gpu_pipeline", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"),
                                      "--only", "learned-kimi-build,learned-kimi-v1,learned-kimi-fp16",
                                      "--set", "target.engine.enforce_eager=true"])
    gpu_pipeline.main()
    jobs = {job.name: job for job in ran}
    assert sorted(jobs) == ["learned-kimi-build", "learned-kimi-fp16", "learned-kimi-v1"]
    assert jobs["learned-kimi-build"].overrides == [] and jobs["learned-kimi-build"].bench
    assert jobs["learned-kimi-v1"].overrides[-1] == "target.engine.enforce_eager=true"
    assert jobs["learned-kimi-fp16"].overrides[-2:] == ["validate.engine_dtype=float16",
                                                         "target.engine.enforce_eager=true"]
    assert jobs["learned-kimi-fp16"].copy_from == "learned-kimi-v1" and jobs["learned-kimi-fp16"].stages == ALL[5:]
    table = {job.name: job for phase in gpu_pipeline.PHASES for chain in phase for job in chain}
    assert "target.engine.enforce_eager=true" not in table["learned-kimi-v1"].overrides
