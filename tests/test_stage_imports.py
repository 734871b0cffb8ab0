"""Stages import forward only: no stage's code (its module and everything it imports, at any depth, function-level
imports included) reaches a module that a later stage owns; 06 reaches neither speculators nor training code.

Read with `ast`, never imported: the walk sees every import, including ones inside functions that a run may
never reach.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from eagle3_pipeline.stage_io import STAGES
from tests.conftest import ROOT, run_python

ORDER = list(STAGES.values())


def module_file(name: str) -> Path | None:
    """The source of a project module (a package's __init__.py), or None for anything else."""
    path = ROOT.joinpath(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_names(path: Path) -> set[str]:
    """Every module an import statement in `path` names: `from a import b` counts `a` and, when a module, `a.b`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names
                      if module_file(f"{node.module}.{alias.name}") is not None}
    return names


def reached(module: str) -> dict[str, str]:
    """Every module `module` imports, at any depth: {name: the project module that imports it}."""
    seen, todo = {module: module}, [module]
    while todo:
        current = todo.pop()
        for name in imported_names(module_file(current)):
            parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]  # packages run first
            for found in (*parents, name):
                if found not in seen:
                    seen[found] = current
                    if module_file(found) is not None:
                        todo.append(found)
    return seen


def owner(module: str) -> str | None:
    for spec in ORDER:
        if any(module == owned or module.startswith(owned + ".") for owned in spec.owns):
            return spec.name
    return None


@pytest.mark.parametrize("spec", ORDER, ids=[spec.name for spec in ORDER])
def test_a_stage_imports_no_later_stage(spec):
    later = {s.name for s in ORDER[ORDER.index(spec) + 1:]}
    wrong = [f"{name} (owned by {owner(name)}, imported by {by})" for name, by in reached(spec.module).items()
             if owner(name) in later]
    assert wrong == [], f"{spec.name} reaches later stages' modules: {wrong}"


def test_every_stage_module_and_script_exists_and_the_script_runs_its_module():
    for spec in ORDER:
        assert module_file(spec.module) is not None, spec.module
        assert owner(spec.module) == spec.name
        script = ast.parse((ROOT / spec.script).read_text())
        imports = {f"{n.module}.{a.name}" for n in ast.walk(script) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert spec.module in imports, spec.script


def test_validation_reaches_neither_speculators_nor_training_code():
    names = reached(STAGES["06_validate"].module)
    assert not [n for n in names if n.split(".")[0] == "speculators" or n.startswith("eagle3_pipeline.train")], names


def test_the_walk_sees_function_level_imports():
    """The checker itself: an import inside a function of a later stage's module counts."""
    assert "eagle3_pipeline.capture.engine" in reached("eagle3_pipeline.capture.stage")  # imported inside a function
    assert owner("eagle3_pipeline.train.data") == "04_train" and owner("eagle3_pipeline.capture.stream") == "02_hidden_states"


def test_every_entry_point_a_script_calls_has_a_docstring():
    """The stage module's functions its numbered script calls (run, and e.g. 05's write_spec_only, 06's check)."""
    missing, called = [], 0
    for spec in ORDER:
        alias = spec.module.rsplit(".", 1)[1]
        script = ast.parse((ROOT / spec.script).read_text())
        names = {n.func.attr for n in ast.walk(script) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and isinstance(n.func.value, ast.Name) and n.func.value.id == alias}
        assert "run" in names, spec.script
        functions = {n.name: n for n in ast.parse(module_file(spec.module).read_text()).body
                     if isinstance(n, ast.FunctionDef)}
        missing += [f"{spec.module}.{name}" for name in sorted(names) if not ast.get_docstring(functions[name])]
        called += len(names)
    assert called > len(ORDER) and missing == []


def test_the_stages_command_lists_each_stage_with_script_module_inputs_and_outputs():
    result = run_python("-m", "eagle3_pipeline", "stages")
    assert result.returncode == 0, result.stderr
    blocks = result.stdout.split("\n0")
    assert len(blocks) == len(ORDER)
    for spec, block in zip(ORDER, blocks):
        assert spec.script in block and spec.module in block and spec.writes in block
        assert all(name in block for name in spec.inputs)


def project_modules() -> list[str]:
    return sorted(".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                  for path in (ROOT / "eagle3_pipeline").rglob("*.py"))


def import_circles() -> list[list[str]]:
    """Circles among the package's modules, through any import (function-level ones included)."""
    modules = set(project_modules())
    edges = {m: sorted(n for n in imported_names(module_file(m)) if n in modules and n != m) for m in modules}
    circles, state = [], {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for name in edges[module]:
            if state.get(name) == "open":
                circles.append(path[path.index(name):] + [name])
            elif name not in state:
                visit(name, path + [name])
        state[module] = "done"

    for module in sorted(modules):
        if module not in state:
            visit(module, [module])
    return circles


def test_the_package_has_no_import_circle():
    assert import_circles() == []


def test_each_package_docstring_lists_its_modules():
    missing = []
    for init in (ROOT / "eagle3_pipeline").rglob("__init__.py"):
        text = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = [path.stem for path in init.parent.glob("*.py") if path.name != "__init__.py"]
        modules += [path.name for path in init.parent.iterdir() if (path / "__init__.py").is_file()]
        missing += [f"{init.parent.name}/{name}" for name in modules if not re.search(rf"\b{name}\b", text)]
    assert missing == []
