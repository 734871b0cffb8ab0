"""Does 06's speed model predict the speed-up vLLM measures? 06 run again and again on one finished run (01-05),
or 06 reports from elsewhere (the H200); per report and phase, the model's parts, its cycle against the measured
one and the predicted against the measured speed-up (eagle3_pipeline/validate/speed.py).

    python -m bench.speed_model --config configs/demo.yaml --set run_dir=RUN --repeats 3 \
        [--set validate.latency_concurrency=[1,4] ...] --out bench/results/speed_model_cpu
    python -m bench.speed_model --reports A/report.json gpu_pipeline.json --out bench/results/speed_model_h200

Each repeat is `06_validate.py --force` with the overrides: both engines started afresh, so the repeats show how
much the measured speed-up itself moves from run to run on the machine, against how far the model misses each.
A report is 06's report.json, or bench.gpu_pipeline's JSON (each job's 06 report). Each row's prediction is the
current model's, from the report's measured parts (`current_model`): a report written before 06 took the time
outside the worker's step on the host's clock is predicted again, its own prediction kept beside.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.harness import parser, run_logged, save, stage_cmd, versions
from eagle3_pipeline.config import load_config

COLUMNS = ("mean_acceptance_length", "target_step_ms", "verify_forward_ms", "draft_step_ms", "sample_ms",
           "outside_step_ms", "measured_outside_step_ms", "fixed_ms", "plain_fixed_ms", "first_draft_round_ms",
           "model_cycle_ms", "cycle_ms", "engine_step_ms", "host_engine_step_ms", "plain_engine_step_ms",
           "plain_host_engine_step_ms", "predicted_speedup", "measured_speedup")


def reports_in(path: Path) -> list[tuple[str, dict]]:
    """The 06 reports a file holds, each with a label: 06's report.json, or each job's of a gpu_pipeline result."""
    data = json.loads(path.read_text())
    if "runs" in data:
        return [((path.parent.parent.name if path.name == "report.json" else path.stem) or str(path), data)]
    return [(job, result["validate"]) for job, result in data.items()
            if isinstance(result, dict) and isinstance(result.get("validate"), dict) and "runs" in result["validate"]]


def current_model(report: dict, phase: str, figures: dict) -> dict:
    """A phase's time outside the worker's step, model cycle and predicted speed-up as 06 takes them now: the
    outside is T less the worker's step without the draft on the host's clock, where the report has it (a GPU's).
    Only the cycle changes, so the report's prediction is scaled by its time with the draft (each group's fixed
    time, then the cycle per decode step) before and after; a report that took it so already keeps its figures."""
    model = {name: figures.get(name) for name in ("outside_step_ms", "model_cycle_ms", "predicted_speedup")}
    host_step = figures.get("plain_host_engine_step_ms")
    if model["predicted_speedup"] is None or host_step is None:
        return model
    outside = figures["target_step_ms"] - host_step
    cycle = figures["model_cycle_ms"] - figures["outside_step_ms"] + outside
    fixed, steps = phase_groups(report, phase, figures) * figures["fixed_ms"], figures["decode_steps"]
    return {"outside_step_ms": outside, "model_cycle_ms": cycle, "predicted_speedup": model["predicted_speedup"]
            * (fixed + figures["model_cycle_ms"] * steps) / (fixed + cycle * steps)}


def phase_groups(report: dict, phase: str, figures: dict) -> int:
    """A phase's groups (requests submitted at once): the report's count, else the eval sources (the eval batch) or
    its requests in groups of the concurrency."""
    if "groups" in figures:
        return figures["groups"]
    return len(report["by_source"]) if phase == "eval batch" else -(-figures["with_draft"]["requests"] // int(phase))


def phase_rows(report: dict, label: str) -> list[dict]:
    """One row per k and phase of a 06 report: the model's parts and both speed-ups, and the model's miss."""
    rows = []
    for run in report["runs"]:
        speed = run["speed"]
        if "by_concurrency" not in speed or "model_cycle_ms" not in speed["eval_batch"]:
            raise ValueError(f"{label}: a 06 report from before the speed model (no model_cycle_ms)")
        for phase, figures in [("eval batch", speed["eval_batch"]), *speed["by_concurrency"].items()]:
            row = {"report": label, "k": run["num_speculative_tokens"], "phase": phase,
                   "requests": figures["with_draft"]["requests"]} | {name: figures.get(name) for name in COLUMNS}
            row["reported_speedup"] = row["predicted_speedup"]
            row |= current_model(report, phase, figures)
            predicted, measured = row["predicted_speedup"], row["measured_speedup"]
            row["error"] = predicted / measured - 1 if predicted and measured else None
            rows.append(row)
    return rows


def markdown(result: dict) -> str:
    def cell(value, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    def reported(row: dict) -> str:
        same = row["reported_speedup"] is None or abs(row["reported_speedup"] - row["predicted_speedup"]) < 5e-4
        return "" if same else f" ({row['reported_speedup']:.3f})"

    lines = [f"# 06's speed model against vLLM's measured speed-up ({result['machine']})", "",
             "    " + result["command"], "",
             "| report | k | phase (requests) | AL | T ms | verify forward ms | D ms | sampling ms | "
             "outside ms without / with the draft | fixed ms with / without | cycle ms model / measured | "
             "speed-up predicted (in the report) / measured | miss |", "|" + "---|" * 13]
    for row in result["rows"]:
        lines.append(
            f"| {row['report']} | {row['k']} | {row['phase']} ({row['requests']}) | "
            f"{cell(row['mean_acceptance_length'], '.3f')} | {cell(row['target_step_ms'])} | "
            f"{cell(row['verify_forward_ms'])} | {cell(row['draft_step_ms'])} | {cell(row['sample_ms'])} | "
            f"{cell(row['outside_step_ms'])} / {cell(row['measured_outside_step_ms'])} | "
            f"{cell(row['fixed_ms'], '.0f')} / {cell(row['plain_fixed_ms'], '.0f')} | "
            f"{cell(row['model_cycle_ms'])} / {cell(row['cycle_ms'])} | "
            f"{cell(row['predicted_speedup'], '.3f')}{reported(row)} / {cell(row['measured_speedup'], '.3f')} | "
            f"{cell(row['error'] * 100 if row['error'] is not None else None, '+.1f')}% |")
    misses = [abs(row["error"]) for row in result["rows"] if row["error"] is not None]
    measured = {}
    for row in result["rows"]:
        measured.setdefault((row["k"], row["phase"]), []).append(row["measured_speedup"])
    lines += ["", f"Largest miss: {max(misses) * 100:.1f}% over {len(misses)} rows." if misses else "No rows.",
              "Measured speed-up from report to report: " + "; ".join(
                  f"k={k} {phase} {min(values):.3f}-{max(values):.3f}"
                  for (k, phase), values in measured.items() if None not in values) + "."]
    return "\n".join(lines) + "\n"


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--config", type=Path, help="a run's config whose 01-05 are done (with --repeats)")
    cli.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    cli.add_argument("--repeats", type=int, default=3)
    cli.add_argument("--reports", type=Path, nargs="+", help="06 report.json files to read instead of running 06")
    cli.add_argument("--machine", default="this machine", help="what the reports ran on, for the report's title")
    cli.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = cli.parse_args()
    if bool(args.config) == bool(args.reports):
        cli.error("give --config (06 runs here) or --reports, not both")
    rows = []
    if args.reports:
        try:
            rows = [row for path in args.reports for label, report in reports_in(path)
                    for row in phase_rows(report, label)]
        except (OSError, ValueError) as err:  # json's errors are ValueErrors
            cli.error(str(err))
    else:
        run_dir = load_config(args.config, args.overrides).run_dir
        args.out.parent.mkdir(parents=True, exist_ok=True)
        for repeat in range(args.repeats):
            run_logged(stage_cmd("06_validate.py", args.config, args.overrides, "--force"),
                       run_dir / f"speed_model_06_{repeat}.log")
            report = run_dir / "06_validate" / "report.json"
            shutil.copy(report, args.out.with_name(f"{args.out.name}_report_{repeat}.json"))
            rows += phase_rows(json.loads(report.read_text()), f"run {repeat + 1}")
    source = (f"--config {args.config} --repeats {args.repeats}" if args.config
              else "--reports " + " ".join(map(str, args.reports)))
    command = " ".join(["python -m bench.speed_model", source, *(f"--set {override}" for override in args.overrides),
                        f"--out {args.out}"])
    result = {"command": command, "machine": args.machine, "versions": versions(), "rows": rows}
    save(args.out.with_suffix(".json"), result)
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
