"""06's outputs: report.json (machine-readable), report.md (for people), acceptance.png, terminal tables."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_pipeline.stage_io import atomic_path, save_figure_atomic, write_json_atomic
from eagle3_pipeline.validate.compare import Difference, ordered


def difference_table(differences: list[Difference]) -> str:
    """A markdown table, breaking differences first."""
    if not differences:
        return "no differences"
    rows = ["| kind | where | difference |", "|---|---|---|"]
    rows += [f"| {d.kind} | {d.where} | {d.message} |" for d in ordered(differences)]
    return "\n".join(rows)


def figure(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def acceptance_table(report: dict) -> str:
    rows = ["| k | mean acceptance length (pooled) | mean of per-request | acceptance per position | drafts | "
            "greedy identical | tokens/s | speed-up |", "|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        per_position = ", ".join(f"{rate:.3f}" for rate in run["acceptance_per_position"])
        identical = "-" if run["greedy_identical_fraction"] is None else f"{run['greedy_identical_fraction']:.2f}"
        speedup = "-" if run["speedup"] is None else f"{run['speedup']:.2f}x"
        rows.append(f"| {run['num_speculative_tokens']} | {run['mean_acceptance_length']:.3f} | "
                    f"{figure(run['mean_request_acceptance_length'])} | {per_position} | {run['num_drafts']} | "
                    f"{identical} | {run['tokens_per_s']:.1f} | {speedup} |")
    return "\n".join(rows)


def speed_table(report: dict) -> str:
    """Per phase: tokens/s and median latency with and without the draft, the step costs the speed model adds up,
    its cycle against the measured one, and the predicted against the measured speed-up."""
    def cell(value, spec: str = ".2f") -> str:
        return "-" if value is None else format(value, spec)

    rows = ["| k | phase (requests) | tokens/s with / without | latency p50 s with / without | T ms | "
            "verify forward ms | D ms | sampling ms | outside ms | cycle ms model / measured | AL | "
            "speed-up predicted / measured |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        for phase, speed in [("eval batch", run["speed"]["eval_batch"]), *run["speed"]["by_concurrency"].items()]:
            with_draft, without = speed["with_draft"], speed["without_draft"] or {}
            rows.append(
                f"| {run['num_speculative_tokens']} | {phase} ({with_draft['requests']}) | "
                f"{with_draft['tokens_per_s']:.1f} / {cell(without.get('tokens_per_s'), '.1f')} | "
                f"{cell(with_draft['latency_s_p50'], '.3f')} / {cell(without.get('latency_s_p50'), '.3f')} | "
                f"{cell(speed['target_step_ms'])} | {cell(speed['verify_forward_ms'])} | "
                f"{cell(speed['draft_step_ms'])} | {cell(speed['sample_ms'])} | {cell(speed['outside_step_ms'])} | "
                f"{cell(speed['model_cycle_ms'])} / {cell(speed['cycle_ms'])} | "
                f"{speed['mean_acceptance_length']:.3f} | "
                f"{cell(speed['predicted_speedup'])} / {cell(speed['measured_speedup'])} |")
    return "\n".join(rows)


# The benchmark table's rows per k: (label, the report key of the figure per source and overall)
BENCHMARK_ROWS = (("vLLM, pooled", "mean_acceptance_length"),
                  ("vLLM, mean of per-request", "mean_request_acceptance_length"),
                  ("04 simulated", "simulated_mean_acceptance_length"))


def benchmark_table(report: dict) -> str:
    """Mean acceptance length per eval source (columns) and k, measured by vLLM two ways and simulated by 04
    (rows; 04's where recorded): the shape of the published draft tables."""
    sources = list(report["by_source"])
    rows = ["| k | measured by | " + " | ".join(f"{s} ({report['by_source'][s]['prompts']})" for s in sources) + " | all |",
            "|---|---|" + "---|" * (len(sources) + 1)]
    for index, run in enumerate(report["runs"]):
        cells = [report["by_source"][s]["runs"][index] for s in sources]
        for label, key in BENCHMARK_ROWS:
            values = [c[key] for c in cells] + [run[key]]
            if any(value is not None for value in values):
                rows.append(f"| {run['num_speculative_tokens']} | {label} | " + " | ".join(map(figure, values)) + " |")
    return "\n".join(rows)


def divergence_table(report: dict) -> str:
    rows = ["| k | eval prompt | source | token | without draft | with draft | target's logit margin "
            "| target alone departs at | its margin there | verdict |", "|---|---|---|---|---|---|---|---|---|---|"]
    for run in report["runs"]:
        for d in run["divergences"]:
            margin = f"{d['margin']:.3f}" if d["margin_exact"] else f">= {d['margin']:.3f}"
            rows.append(f"| {run['num_speculative_tokens']} | {d['prompt']} | {d['source']} | {d['position']} | "
                        f"{d['without_draft']} | {d['with_draft']} | {margin} | "
                        f"{alone_cell(d['alone_departs_at'])} | {alone_cell(d['alone_margin'], '.3f')} | "
                        f"{d['verdict']} |")
    return "\n".join(rows) if len(rows) > 2 else "none: every greedy output is the same with and without the draft"


def alone_cell(value: float | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def write_reports(folder: Path, report: dict) -> None:
    write_json_atomic(folder / "report.json", report)
    with atomic_path(folder / "report.md") as tmp:
        tmp.write_text(markdown(report))
    if report["runs"]:
        plot_acceptance(folder / "acceptance.png", report)


def markdown(report: dict) -> str:
    lines = [f"# Validation of {report['export']}", "", f"**Verdict: {report['verdict']}**", ""]
    lines += [f"- {problem}" for problem in report["problems"]] + [""]
    for fmt, differences in report["static_differences"].items():
        lines += [f"## Static check: {fmt}", "", difference_table([Difference(**d) for d in differences]), ""]
    if report["runs"]:
        lines += ["## Acceptance in vLLM (eval prompts, greedy)", "", acceptance_table(report), "",
                  (f"{report['prompts']} prompts, up to {report['max_tokens']} tokens each. Eval step-0 accuracy "
                   f"from 04_train: {report['eval_step0_accuracy']}; first-position acceptance must reach "
                   f"{report['min_acceptance_ratio']} x that."), "", "![acceptance](acceptance.png)", "",
                  "## Speed", "", speed_table(report), "",
                  ("Eval batch: the prompts of each eval source submitted at once; a number: the first prompts in "
                   "groups of that many (1: one at a time). Latency: time to the first token plus decode time "
                   "(vLLM's request timestamps). T: wall time per decode step without the draft. The model's "
                   "cycle: the verifying forward + k·D (D: a timed drafting round / k) + sampling and rejection "
                   "(the worker's means over decode steps with the draft) + the time outside the worker's step (T "
                   "less the worker's step without the draft, on the host's clock); measured cycle: each group's decode span with the "
                   "draft / its decode steps (its slowest request's verifying steps). Predicted speed-up: each "
                   "group's fixed time, then T per decode step without the draft and one cycle per decode step "
                   "with it (eagle3_pipeline/validate/speed.py)."), "",
                  "## Mean acceptance length per eval source", "", benchmark_table(report), "",
                  ("Pooled: 1 + accepted / drafts over all requests (vLLM's spec-decode counters). Mean of "
                   "per-request: each request's tokens from verifying steps / its verifying steps, averaged over "
                   "requests (eagle3_pipeline/validate/request_steps.py). 04 simulated: greedy chain drafting "
                   "replayed on 01's greedy answers by 04's last eval (eagle3_pipeline/train/acceptance.py)."), "",
                  "## Greedy outputs that differ with the draft", "", divergence_table(report),
                  "", f"A bf16 near-tie: the target's margin between the two tokens is at most validate.max_tie_margin "
                  f"({report['max_tie_margin']}) on a fresh prefill of the common prefix. The target's own batch "
                  "variance: a fresh prefill prefers the token written with the draft (a negative margin), or the "
                  "target alone, the prompt by itself without the draft, leaves its batched output at that same "
                  "token, or the margin is at most the largest at which the target alone leaves its batched output "
                  f"on these prompts ({report['batch_variance_margin']:.3f}: an MoE router in bf16 picks other "
                  "experts when the batch changes).", ""]
    lines += ["## Serving", "", "```", report["serving_command"], "```", ""]
    return "\n".join(lines)


def plot_acceptance(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for run in report["runs"]:
        rates = run["acceptance_per_position"]
        ax.plot(range(1, len(rates) + 1), rates, "o-",
                label=f"k={run['num_speculative_tokens']}: mean acceptance length {run['mean_acceptance_length']:.2f}")
    if report["eval_step0_accuracy"] is not None:
        ax.axhline(report["eval_step0_accuracy"], color="grey", ls="--", label="04 eval step-0 accuracy")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (this and every earlier token)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path)


def print_summary(report: dict) -> None:
    print(json.dumps({k: report[k] for k in ("mean_acceptance_length", "mean_request_acceptance_length",
                                              "acceptance_per_position", "num_speculative_tokens",
                                              "greedy_identical_fraction")}))
    if report["runs"]:
        print(acceptance_table(report))
        print(speed_table(report))
        print(benchmark_table(report))
        if any(run["divergences"] for run in report["runs"]):
            print(divergence_table(report))
    print(f"serve it with:\n  {report['serving_command']}")
    print(f"06_validate: {report['verdict']}" + "".join(f"\n  - {p}" for p in report["problems"]))
