"""What the benches share: where things are, a phase clock, logged subprocess runs of the stage scripts, cached
and saved results, package versions and the spread of a figure over seeds."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from eagle3_pipeline.stage_io import package_versions

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
PY = sys.executable


class Clock:
    """Wall seconds per phase of a bench, with the machine's load at the end of each (wall times only compare on
    a quiet machine)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.load_averages: list[float] = []  # 1-minute load average at the end of each phase

    def phase(self, name: str, seconds: float) -> None:
        self.phases[name] = round(self.phases.get(name, 0.0) + seconds, 1)
        self.load_averages.append(round(os.getloadavg()[0], 2))
        self.say(f"{name}: {seconds:.0f} s")

    def say(self, text: str) -> None:
        print(f"[bench {time.perf_counter() - self.start:7.0f} s] {text}", flush=True)


LAST_CPU_S: list[float] = [0.0]  # CPU seconds (user + sys) of the last run_logged command and its children


def run_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """Run a command from the project's root with its output in `log`; wall seconds (its CPU seconds in
    LAST_CPU_S). Raises with the log's tail on failure."""
    log.parent.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        code = subprocess.call(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env or os.environ.copy())
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    LAST_CPU_S[0] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1)
    if code:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise RuntimeError(f"{' '.join(cmd[:2])} failed ({code}); {log}:\n{tail}")
    return seconds


def stage_cmd(script: str, config: Path, overrides: list[str], *extra: str) -> list[str]:
    """A numbered stage script's command line: `--config` and one `--set` per override."""
    return [PY, script, "--config", str(config), *(word for item in overrides for word in ("--set", item)), *extra]


def cached(path: Path, force: bool = False):
    """A result saved earlier, or None (missing, or `force`)."""
    return None if force or not path.exists() else json.loads(path.read_text())


def save(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def versions() -> dict[str, str]:
    """The packages a result depends on (as stage manifests record them), with NCCL's where CUDA is present."""
    found = package_versions()
    import torch

    if torch.cuda.is_available():
        found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return found


def spread(values: list[float]) -> dict:
    """A figure over seeds: mean, range, standard deviation and each seed's value."""
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "std": statistics.stdev(values) if len(values) > 1 else 0.0, "per_seed": values}


def spread_text(values: list[float]) -> str:
    """`mean [min, max]` to 3 decimals (the value alone for one seed)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.fmean(values):.3f} [{min(values):.3f}, {max(values):.3f}]"
