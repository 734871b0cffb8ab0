"""What the benches share: where things are, a command line, a phase clock, logged subprocess runs of the stage
scripts, cached and saved results, package versions, the spread of a figure over seeds, stand-ins for packages
speculators imports but never calls."""

from __future__ import annotations

import argparse
import importlib.util
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
# The MLA draft layer's heads (draft.attention=mla): Kimi-K2.5's own, the only ones vLLM's GPU MLA prefill backends
# take; reference format only (speculators has no MLA draft class)
MLA_HEADS = ["draft.attention=mla", "draft.kv_lora_rank=512", "draft.qk_nope_head_dim=128",
             "draft.qk_rope_head_dim=64", "draft.v_head_dim=128", "export.formats=[reference]"]


def parser(doc: str) -> argparse.ArgumentParser:
    """A bench's command line, its module docstring as `--help`."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def offline() -> None:
    """Hugging Face's hub unasked: the stand-ins and the wheels' data are local."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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


def logged_call(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[int, float]:
    """Run a command from the project's root with its output in `log` (the command line first): its exit status
    and wall seconds (its CPU seconds in LAST_CPU_S)."""
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
    return code, seconds


def run_logged(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> float:
    """logged_call's wall seconds; raises with the log's tail on failure."""
    code, seconds = logged_call(cmd, log, env)
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


def save(path: Path, data, indent: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str) + "\n")


def failure(err: BaseException, limit: int = 2000) -> str:
    """An exception as a result records it (one failed variant is reported, the others go on)."""
    return f"{type(err).__name__}: {err}"[:limit]


def synchronize(device) -> None:
    """Wait for the device's queued work (a no-op on CPU): what a wall-clock measurement of GPU work needs."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


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


# speculators imports these at module level (its data and client modules); no bench calls them
IMPORTED_NOT_CALLED = {"datasets": (), "openai": ("types", "types.chat", "types.completion")}
STAND_IN = ("def __getattr__(name):  # empty stand-in: imported by speculators, never called\n"
            "    if name.startswith('__'):\n        raise AttributeError(name)\n    return type(name, (), {})\n")


def stand_ins(folder: Path, packages: dict[str, tuple[str, ...]] = IMPORTED_NOT_CALLED) -> str | None:
    """Empty packages (their named submodules too) under `folder` for those of `packages` not installed: appended
    to sys.path here; returns the folder for a launched process's PYTHONPATH (None: nothing missing)."""
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    for name in missing:
        for module in ("", *packages[name]):
            path = folder.joinpath(name, *filter(None, module.split(".")), "__init__.py")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(STAND_IN)
    if not missing:
        return None
    print(f"note: {', '.join(missing)} not installed: empty stand-ins in {folder}", flush=True)
    sys.path.append(str(folder))
    return str(folder)
