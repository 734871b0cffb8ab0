"""A released vLLM's Python source, read as syntax trees: nothing of it is imported or run.

`make setup` downloads the wheel, pinned by sha256 in requirements-vllm-source.txt, into
`$EAGLE3_CACHE_DIR/wheels/` (default `~/.cache/eagle3_pipeline/wheels/`); the tests check its digest, unpack
its Python files beside it once, and fail (never skip) when it is missing: the run downloads nothing.
"""

from __future__ import annotations

import ast
import hashlib
import re
import shutil
import zipfile
from pathlib import Path

import pytest

from eagle3_pipeline.stage_io import file_sha256
from eagle3_pipeline.stand_ins import cache_dir
from tests.conftest import ROOT

PINS = ROOT / "requirements-vllm-source.txt"


def pinned_digests(version: str) -> set[str]:
    """The sha256 digests requirements-vllm-source.txt pins for vllm==`version` (none when unpinned)."""
    text = PINS.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.split("#")[0].split() and line.split()[0] == f"vllm=={version}":
            return set(re.findall(r"--hash=sha256:([0-9a-f]{64})", line))
    return set()


def unpacked_vllm(version: str) -> Path:
    """The folder holding `vllm/**.py` of vLLM `version`, from its pinned wheel in the cache."""
    wheels = cache_dir() / "wheels"
    digests = pinned_digests(version)
    if not digests:
        pytest.fail(f"vllm=={version} has no sha256 pin in {PINS.name}: add it, then run `make setup`", pytrace=False)
    wheel = next(wheels.glob(f"vllm-{version}-*.whl"), None)
    if wheel is None:
        pytest.fail(f"the vllm=={version} wheel is not in {wheels}: run `make setup` (it downloads the wheel "
                    f"pinned in {PINS.name})", pytrace=False)
    if file_sha256(wheel) not in digests:
        pytest.fail(f"{wheel}: sha256 {file_sha256(wheel)} is none of the pins in {PINS.name}: delete it and run "
                    "`make setup`", pytrace=False)
    folder = wheels / f"{wheel.stem}-py"
    if (folder / "vllm" / "__init__.py").is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(partial, [n for n in archive.namelist() if n.startswith("vllm/") and n.endswith(".py")])
    partial.rename(folder)  # complete under its final name only
    return folder


class Source:
    """Look-ups in a source tree that fail with a message naming what is missing.

    Files missing under `root` are read from `fallback`: a tree with one file changed is that file alone.
    """

    def __init__(self, root: Path, fallback: Path | None = None):
        self.root, self.fallback = root, fallback
        self._parsed: dict[str, ast.Module] = {}

    def module(self, path: str) -> ast.Module:
        if path not in self._parsed:
            file = self.root / path
            if not file.is_file() and self.fallback is not None:
                file = self.fallback / path
            assert file.is_file(), f"{path} is missing"
            self._parsed[path] = ast.parse(file.read_text(), filename=path)
        return self._parsed[path]

    def cls(self, path: str, name: str) -> ast.ClassDef:
        for node in self.module(path).body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return node
        raise AssertionError(f"{path}: class {name} is missing")

    def function(self, path: str, name: str, cls: str | None = None) -> ast.FunctionDef:
        body = self.cls(path, cls).body if cls else self.module(path).body
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return node
        raise AssertionError(f"{path}: {cls + '.' if cls else ''}{name} is missing")

    def has_function(self, path: str, name: str, cls: str) -> bool:
        return any(isinstance(n, ast.FunctionDef) and n.name == name for n in self.cls(path, cls).body)


def parameters(function: ast.FunctionDef) -> str:
    """The parameter list as source, without annotations: `self, *, vllm_config, prefix=''`."""
    args = function.args
    plain = ast.arguments(
        posonlyargs=[ast.arg(a.arg) for a in args.posonlyargs],
        args=[ast.arg(a.arg) for a in args.args],
        vararg=args.vararg and ast.arg(args.vararg.arg),
        kwonlyargs=[ast.arg(a.arg) for a in args.kwonlyargs],
        kw_defaults=args.kw_defaults,
        kwarg=args.kwarg and ast.arg(args.kwarg.arg),
        defaults=args.defaults,
    )
    return ast.unparse(plain)


def body_fingerprint(function: ast.FunctionDef) -> str:
    """A hash of a function's statements: unchanged by formatting and comments, changed by any edit."""
    return hashlib.sha256(ast.dump(ast.Module(body=function.body, type_ignores=[])).encode()).hexdigest()[:16]


def calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def call_name(call: ast.Call) -> str:
    return ast.unparse(call.func)
