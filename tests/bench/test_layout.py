"""bench/ as a package a newcomer can read: every module listed in the package docstring and the README's index
(or named there as a part of the benches), every function short, the harness's shared parts working."""

from __future__ import annotations

import ast
import sys

import pytest

from bench import harness
from tests.conftest import ROOT

BENCH = ROOT / "bench"
MODULES = sorted(path.stem for path in BENCH.glob("*.py") if path.name != "__init__.py")


def test_every_module_is_listed_in_the_package_docstring_and_the_readme():
    import bench

    listed = {line.split()[0] for line in bench.__doc__.splitlines() if line.startswith("    ")}
    assert listed == set(MODULES)
    readme = (BENCH / "README.md").read_text()
    assert all(f"`{name}`" in readme for name in MODULES)


def test_no_function_is_longer_than_60_lines():
    long = []
    for name in MODULES:
        for node in ast.walk(ast.parse((BENCH / f"{name}.py").read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long


def test_a_failed_command_raises_with_its_log_tail(tmp_path):
    assert harness.run_logged([sys.executable, "-c", "print('fine')"], tmp_path / "ok.log") >= 0
    assert (tmp_path / "ok.log").read_text().splitlines()[1:] == ["fine"]  # the command line first
    with pytest.raises(RuntimeError, match="failed \\(3\\).*\n.*boom"):
        harness.run_logged([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], tmp_path / "bad.log")
    assert harness.logged_call([sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "bad.log")[0] == 3


def test_stand_ins_for_missing_packages_import_and_yield_empty_classes(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert harness.stand_ins(tmp_path, {"json": ()}) is None  # installed: nothing written
    folder = harness.stand_ins(tmp_path, {"no_such_package_here": ("types", "types.chat")})
    assert folder == str(tmp_path) and folder in sys.path
    from no_such_package_here.types.chat import ChatCompletion  # noqa: PLC0415

    assert isinstance(ChatCompletion, type)
    for name in [m for m in sys.modules if m.startswith("no_such_package_here")]:
        monkeypatch.delitem(sys.modules, name)


def test_cached_and_saved_results(tmp_path):
    path = tmp_path / "a" / "result.json"
    assert harness.cached(path) is None
    harness.save(path, {"x": 1, "p": tmp_path})
    assert harness.cached(path) == {"x": 1, "p": str(tmp_path)} and harness.cached(path, force=True) is None
    assert harness.stage_cmd("04_train.py", "c.yaml", ["a=1", "b=2"], "--resume")[1:] == [
        "04_train.py", "--config", "c.yaml", "--set", "a=1", "--set", "b=2", "--resume"]
    assert harness.spread_text([1.0]) == "1.000" and harness.spread_text([1.0, 2.0, 3.0]) == "2.000 [1.000, 3.000]"
