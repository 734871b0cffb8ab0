"""The benches' reports rendered from their saved results: markdown tables and plots. Measuring lives in each
bench's module; `python -m bench.report NAME RESULT.json` renders a saved result again.

    quality       bench/quality.py's report (CPU, SmolLM2): quality_markdown, quality_plot
    quality_gpu   bench/quality_gpu.py's report (one GPU): quality_gpu_markdown, quality_gpu_plot
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from bench.harness import parser, spread_text
from eagle3_pipeline.acceptance import metric_key


def row(cells) -> str:
    """A markdown table's row."""
    return "| " + " | ".join(cells) + " |"


def head(cells) -> list[str]:
    """A markdown table's header and rule (a cell may hold several columns, as "a | b")."""
    line = row(cells)
    return [line, "|---" * (line.count("|") - 1) + "|"]


def spread_figure(spread: dict, decimals: int = 3) -> str:
    """A harness.spread as `mean [min, max]`."""
    return f"{spread['mean']:.{decimals}f} [{spread['min']:.{decimals}f}, {spread['max']:.{decimals}f}]"


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


# -------------------------------------------------------------------------------------- bench/quality.py
def main_trainers(report: dict) -> list[str]:
    """The bench's four drafts (bench/quality.py, DRAFTS) that have results, in the results' order."""
    return [trainer for trainer in report["results"] if trainer in report["main"]]


def target_lines(report: dict) -> list[str]:
    """The two targets (ours in the reference layout >= speculators' defaults; ours in speculators' layout >= 5%
    ahead of them), per k and eval source."""
    res, spec, out = report["results"], report["results"]["speculators"], []
    for name, needed in (("ours", 1.0), ("ours+specnorms", 1.05)):
        for k in report["ks"]:
            for scope, pick in [("all prompts", lambda e: e["k"][str(k)]["mean_acceptance_length_spread"])] + [
                    (source, lambda e, source=source: e["k"][str(k)]["by_source"][source]["mean_acceptance_length"])
                    for source in spec["k"][str(k)]["by_source"]]:
                a, b = pick(res[name]), pick(spec)
                ratio = a["mean"] / b["mean"]
                every = all(v > b["mean"] * needed for v in a["per_seed"])
                out.append(f"k={k}, {scope}: {name} ({res[name]['layout']} layout) {a['mean']:.3f} vs speculators "
                           f"{b['mean']:.3f} ({100 * (ratio - 1):+.1f}%; target {100 * (needed - 1):+.0f}%: "
                           f"{'met' if ratio >= needed else 'missed'}; every seed of {name} above "
                           f"{needed:.2f} x speculators' mean: {'yes' if every else 'no'}, worst seed {a['min']:.3f})")
    return out


def ablation_lines(report: dict) -> list[str]:
    """Each ablation against its base draft at the same seeds."""
    out = []
    for name, base in report["ablation_bases"].items():
        if name not in report["results"]:
            continue
        e = report["results"][name]
        base_runs = [r for r in report["runs"] if r["trainer"] == base and r["seed"] in e["seeds"]]
        line = f"ablation {name} (seed {','.join(map(str, e['seeds']))}) vs {base} at the same seed(s)"
        for k in (k for k in report["ks"] if str(k) in e["k"]):
            base_mal = statistics.fmean(r["serve"][str(k)]["mean_acceptance_length"] for r in base_runs)
            base_sim = statistics.fmean(r["shared_eval"][metric_key(k)] for r in base_runs)
            line += (f"; k={k} mean acceptance length {e['k'][str(k)]['mean_acceptance_length']:.3f} vs "
                     f"{base_mal:.3f} (simulated {e['k'][str(k)]['simulated_mean_acceptance_length']['mean']:.3f}"
                     f" vs {base_sim:.3f})")
        out.append(line)
    return out


def comparison_lines(report: dict) -> list[str]:
    """The targets, the teacher-forced figures and training cost of ours against speculators, the ablations."""
    res = report["results"]
    if not all(t in res for t in report["main"]):
        return []
    ours, spec = res["ours"], res["speculators"]
    se_o, se_s = ours["shared_eval"], spec["shared_eval"]
    out = target_lines(report)
    out.append("teacher-forced (shared evaluator), ours vs speculators: " + ", ".join(
        f"acc_{k} {se_o[f'acc_{k}']['mean']:.3f} vs {se_s[f'acc_{k}']['mean']:.3f}" for k in range(report["ttt_steps"])))
    out.append(f"training wall time ours {ours['train_wall_s']['mean']:.0f} s vs speculators "
               f"{spec['train_wall_s']['mean']:.0f} s for {ours['train_tokens']['mean']:.0f} vs "
               f"{spec['train_tokens']['mean']:.0f} tokens ({ours['optimizer_steps']['mean']:.0f} vs "
               f"{spec['optimizer_steps']['mean']:.0f} optimizer steps)")
    return [f"- {line}" for line in out + ablation_lines(report)]


def benchmark_table(report: dict) -> list[str]:
    """Mean acceptance length per eval source and k, vLLM's and the simulated one, per draft of the 2 x 2."""
    res, ks = report["results"], report["ks"]
    by_source = res["ours"]["k"][str(ks[0])]["by_source"]
    header = ["trainer", "layout"] + [f"{source} k={k} ({by_source[source]['prompts']}) | simulated"
                                      for k in ks for source in by_source] + [f"all k={k} | simulated" for k in ks]
    lines = head(header)
    for name in report["main"]:
        e = res[name]
        cells = [e["trainer"], e["layout"]]
        for k in ks:
            for source in by_source:
                by = e["k"][str(k)]["by_source"][source]
                cells += [spread_figure(by["mean_acceptance_length"]), spread_figure(by["simulated_mean_acceptance_length"])]
        for k in ks:
            cells += [spread_figure(e["k"][str(k)]["mean_acceptance_length_spread"]),
                      spread_figure(e["k"][str(k)]["simulated_mean_acceptance_length"])]
        lines.append(row(cells))
    return lines


def quality_head(report: dict) -> list[str]:
    drafts, machine = len(report["main"]), report["machine"]
    invocations = "; ".join(f"`{i['command'].split('python ')[-1]}` {i['wall_s'] / 60:.1f} min"
                            for i in report.get("invocations", []))
    return [
        "# Draft quality: our trainer vs speculators 0.9.0's `speculators train`, each in both layouts",
        "",
        f"Command: `{report['command']}`  ",
        f"Wall time: {report['work_s']['main_comparison_total'] / 60:.1f} min for the comparison from scratch (sum of "
        f"its phases: stages 01-03, {drafts * len(report['seeds'])} trainings, "
        f"{len(report['ks']) * len(report['seeds']) * drafts} vLLM engine runs, "
        f"shared eval; {machine['cpus']} CPU cores, 1-minute load average {machine['load_min']:.1f}"
        f"-{machine['load_max']:.1f} at the ends of its phases); this invocation "
        f"{report['wall_time_s']['total'] / 60:.1f} min (all invocations: {invocations}); target {report['target']}; "
        f"seeds {report['seeds']}; {report['eval_prompts']} held-out eval prompts x {report['max_tokens']} tokens, "
        "greedy, vLLM acceptance counters (06's `serve`). Figures: mean [min, max] over the seeds.",
        "",
        "Mean acceptance length per held-out eval source (served turns in brackets; MT-Bench both turns, the "
        "second after the target's own first answer; HumanEval's first 16 problems, never trained on), vLLM's "
        "counters beside 04's simulation (bench/draft_eval.py replaying greedy chain drafting on the same answers):",
        "",
        *benchmark_table(report),
    ]


def quality_served(report: dict) -> list[str]:
    ks = report["ks"]
    lines = ["", *head(["trainer", "train wall s", "train tokens", "steps"]
                       + [f"mean acc. length k={k} | accept. per position k={k}" for k in ks])]
    for trainer in main_trainers(report):
        e = report["results"][trainer]
        cells = [trainer, spread_figure(e["train_wall_s"], 0), f"{e['train_tokens']['mean']:.0f}",
                 f"{e['optimizer_steps']['mean']:.0f}"]
        for k in ks:
            served = e["k"][str(k)]
            cells += [spread_figure(served["mean_acceptance_length_spread"]),
                      " / ".join(f"{p:.3f}" for p in served["acceptance_per_position"])]
        lines.append(row(cells))
    return lines


def quality_teacher_forced(report: dict) -> list[str]:
    ttt = range(report["ttt_steps"])
    lines = ["", "Teacher-forced eval on our eval split, one shared evaluator for both (bench/draft_eval.py): "
             "acc_k = step-k top-1 agreement with the verifier; chain_k = steps 0..k all agree.", "",
             *head(["trainer"] + [f"{name}_{k}" for name in ("acc", "chain", "KL") for k in ttt])]
    for trainer in main_trainers(report):
        shared = report["results"][trainer]["shared_eval"]
        lines.append(row([trainer] + [spread_figure(shared[f"{name}_{k}"]) for name in ("acc", "chain_acc", "loss")
                                      for k in ttt]))
    return lines


def quality_ablations(report: dict) -> list[str]:
    res, ks = report["results"], report["ks"]
    ablations = [t for t in res if t not in report["main"]]
    if not ablations:
        return []
    lines = ["", "Ablations (one setting of one trainer moved to the other's choice; same data, budget, shape):", "",
             *head(["draft", "seeds", "train wall s", "chain_0", "chain_1", "chain_2"]
                   + [f"mean acc. length k={k}" for k in ks])]
    for trainer in list(report["main"]) + ablations:
        e = res[trainer]
        lines.append(row([trainer, ",".join(map(str, e["seeds"])), spread_figure(e["train_wall_s"], 0)] + [
            spread_figure(e["shared_eval"][f"chain_acc_{k}"]) for k in range(3)] + [
            spread_figure(e["k"][str(k)]["mean_acceptance_length_spread"]) if str(k) in e["k"] else "-" for k in ks]))
    return lines


def quality_own_evals(report: dict) -> list[str]:
    lines = ["", "Each trainer's own eval metric (its definition differs; see quality.json):", ""]
    for trainer in main_trainers(report):
        e = report["results"][trainer]
        keys = [k for k in e["own_eval"][0] or {} if k.startswith(("acc_", "full_acc_", "cond_acc_"))]
        lines.append(f"- {trainer}: " + ", ".join(
            f"{key} {statistics.fmean([(o or {}).get(key, float('nan')) for o in e['own_eval']]):.3f}" for key in keys))
    return lines


def quality_markdown(report: dict) -> str:
    lines = [*quality_head(report), *quality_served(report), *quality_teacher_forced(report),
             *quality_ablations(report), *quality_own_evals(report),
             "", "## Measured differences", "", *comparison_lines(report)]
    if report.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def bars(ax, trainers: list[str], groups: int, values, capsize: int = 3, annotate: bool = False) -> None:
    """One bar per trainer in each of `groups` groups, min-max error bars: values(trainer) -> means, lows, highs."""
    width = 0.8 / len(trainers)
    for i, trainer in enumerate(trainers):
        means, lows, highs = values(trainer)
        x = [j + (i - (len(trainers) - 1) / 2) * width for j in range(groups)]
        err = [[m - lo for m, lo in zip(means, lows)], [hi - m for m, hi in zip(means, highs)]]
        ax.bar(x, means, width, yerr=err, capsize=capsize, label=trainer, color=f"C{i}")
        for xi, m in zip(x, means) if annotate else ():
            ax.text(xi, m + 0.02, f"{m:.2f}", ha="center", va="bottom", fontsize=8)
    ax.grid(axis="y", alpha=0.3)


def quality_plot(report: dict, path: Path) -> None:
    res, ks = report["results"], report["ks"]
    trainers = main_trainers(report)
    fig, axes = pyplot().subplots(1, 1 + len(ks), figsize=(5 * (1 + len(ks)), 4.2))

    def mal(trainer):
        spreads = [res[trainer]["k"][str(k)]["mean_acceptance_length_spread"] for k in ks]
        return [s["mean"] for s in spreads], [s["min"] for s in spreads], [s["max"] for s in spreads]

    bars(axes[0], trainers, len(ks), mal, capsize=4, annotate=True)
    axes[0].set_xticks(range(len(ks)), [f"k = {k}" for k in ks])
    axes[0].set(ylabel="mean acceptance length (vLLM)", title="mean acceptance length, min-max over seeds")
    axes[0].legend(fontsize=8)
    for ax, k in zip(axes[1:], ks):
        bars(ax, trainers, k, lambda t, k=k: [res[t]["k"][str(k)][f"acceptance_per_position{end}"]
                                                for end in ("", "_min", "_max")])
        ax.set_xticks(range(k), [str(j + 1) for j in range(k)])
        ax.set(xlabel="draft position", ylabel="acceptance rate", title=f"acceptance per position, k = {k}")
    save_figure(fig, path)


# ---------------------------------------------------------------------------------- bench/quality_gpu.py
def sources_of(report: dict) -> list[str]:
    prefix = f"{metric_key(report['k'])}/"  # the k the bench serves and simulates at
    for record in report["drafts"].values():
        if "shared_eval" in record:
            return [key.split("/", 1)[1] for key in record["shared_eval"] if key.startswith(prefix)]
    return []


class GpuReport:
    """bench/quality_gpu.py's report, one method per section; each returns its lines (none when it has nothing)."""

    def __init__(self, report: dict):
        self.report, self.served_k = report, report["k"]  # the k the bench serves and simulates at
        self.drafts = {n: r for n, r in report["drafts"].items() if "shared_eval" in r}
        self.sources = sources_of(report)
        self.largest = max(report["curve_steps"])
        self.config = report.get("config", "bench/quality_gpu.yaml")  # reports from before it was recorded: SmolLM2's
        self.seeds = {}  # trainer -> its drafts at the largest point, one per seed
        for trainer in ("ours", "speculators"):
            runs = [self.drafts[n] for n in (f"{trainer}-{self.largest}-s{s}" for s in range(3)) if n in self.drafts]
            if runs:
                self.seeds[trainer] = runs

    def sim(self, record: dict, source: str | None = None) -> float:
        return record["shared_eval"][metric_key(self.served_k, source=source) if source else metric_key(self.served_k)]

    def mean_of_sources(self, record: dict) -> float:
        return statistics.fmean(self.sim(record, s) for s in self.sources)

    def figures(self, runs: list[dict]) -> list[str]:
        """Per source, the mean of benchmarks and all prompts: each a spread over `runs`."""
        return ([spread_text([self.sim(r, s) for r in runs]) for s in self.sources]
                + [spread_text([self.mean_of_sources(r) for r in runs]), spread_text([self.sim(r) for r in runs])])

    def head(self) -> list[str]:
        report = self.report
        lines = [
            # reports from before the GPU and target were recorded: SmolLM2 on an H200
            f"# Draft quality at scale on one {report.get('gpu', 'H200')}: our trainer against speculators 0.9.0's",
            "",
            "Commands, in order (each rerun skips the work an earlier one finished): "
            + "; ".join(f"`{command}`" for command in report["commands"]) + f" ({self.config}). Target "
            f"{report.get('target', 'SmolLM2-135M-Instruct')} (stand-in), every training answer regenerated by it; "
            f"acceptance length (AL) at "
            f"k={self.served_k}, simulated by one shared evaluator (bench/draft_eval.py: 04's greedy chain replay on "
            "the held-out eval answers) unless marked vLLM.",
            "",
        ]
        if report.get("data"):
            data = report["data"]
            lines += [f"Data: {data['train_conversations']} training conversations, {data['train_tokens']} tokens "
                      f"({data['loss_tokens']} loss-masked); 01-03 took "
                      + ", ".join(f"{k[:2]} {v:.0f} s" for k, v in data["stage_seconds"].items())
                      + (f"; 01 generated {data['generation']['tokens_per_s']:.0f} tokens/s"
                         if data.get("generation") else "") + ".", ""]
        return lines

    def curve(self) -> list[str]:
        curve = [steps for steps in sorted(self.report["curve_steps"]) if f"ours-{steps}-s0" in self.drafts]
        if len(curve) < 2:  # a run of the largest point alone has no curve to show
            return []
        header = ["draft", "train tokens", "train wall s"] + self.sources + ["mean of benchmarks", "all prompts"]
        lines = ["## Learning curve (seed 0; speculators trains on the tokens ours does at each point)", "",
                 *head(header)]
        for trainer in ("ours", "speculators"):
            for steps in curve:
                record = self.drafts.get(f"{trainer}-{steps}-s0")
                if record:
                    lines.append(row([f"{trainer} ({steps} steps)", str(record["train_tokens"]),
                                      f"{record['train_wall_s']:.0f}"]
                                     + [f"{self.sim(record, s):.3f}" for s in self.sources]
                                     + [f"{self.mean_of_sources(record):.3f}", f"{self.sim(record):.3f}"]))
        return lines

    def three_seeds(self) -> list[str]:
        lines = ["", f"## Three seeds at the largest point ({self.largest} steps): mean [min, max]", "",
                 *head(["trainer"] + self.sources + ["mean of benchmarks", "all prompts"])]
        return lines + [row([f"{trainer} ({len(runs)} seeds)"] + self.figures(runs))
                        for trainer, runs in self.seeds.items()]

    def targets(self) -> list[str]:
        if len(self.seeds) < 2:
            return []
        lines = ["", "Targets (ours in the reference layout at least 3% above speculators' defaults, every seed "
                 "above their mean):", ""]
        for scope, pick in [("MT-Bench", lambda r: self.sim(r, "mtbench")), ("mean of benchmarks", self.mean_of_sources)]:
            if scope == "MT-Bench" and "mtbench" not in self.sources:
                continue
            ours = [pick(r) for r in self.seeds["ours"]]
            theirs = statistics.fmean(pick(r) for r in self.seeds["speculators"])
            ratio = statistics.fmean(ours) / theirs - 1
            lines.append(f"- {scope}: ours {statistics.fmean(ours):.3f} vs speculators {theirs:.3f} "
                         f"({100 * ratio:+.1f}%; target +3%: {'met' if ratio >= 0.03 else 'missed'}; every seed above "
                         f"their mean: {'yes' if min(ours) > theirs else 'no'})")
        return lines

    def levers(self) -> list[str]:
        levers: dict[str, list[dict]] = {}  # lever -> its drafts, one per seed
        for name, record in self.drafts.items():
            if not name.startswith(("ours-", "speculators-")):
                levers.setdefault(name.rsplit("-", 2)[0], []).append(record)
        if not levers:
            return []
        mean = lambda runs: statistics.fmean(map(self.mean_of_sources, runs))  # noqa: E731
        trainers = ("ours; `speculators.*`: speculators' trainer with those flags" if any(
            lever.startswith("speculators.") for lever in levers) else "ours")
        lines = ["", f"## Levers at {self.largest} steps ({trainers}; one setting moved from {self.config})", "",
                 *head(["lever", "seeds", "overrides", *self.sources, "mean of benchmarks", "vs ours, same seeds",
                        "vs speculators' mean (every seed above it)"])]
        theirs = mean(self.seeds["speculators"]) if "speculators" in self.seeds else None
        for lever, runs in sorted(levers.items(), key=lambda item: -mean(item[1])):
            runs = sorted(runs, key=lambda r: r["seed"])
            base = [self.drafts[f"ours-{self.largest}-s{r['seed']}"] for r in runs
                    if f"ours-{self.largest}-s{r['seed']}" in self.drafts]
            versus = f"{100 * (mean(runs) / mean(base) - 1):+.1f}%" if len(base) == len(runs) else "-"
            above = (f"{100 * (mean(runs) / theirs - 1):+.1f}% "
                     f"({'yes' if min(map(self.mean_of_sources, runs)) > theirs else 'no'})" if theirs else "-")
            lines.append(row([lever, ",".join(str(r["seed"]) for r in runs), "`" + " ".join(runs[0]["extra"]) + "`"]
                             + self.figures(runs)[:-1] + [versus, above]))
        return lines

    def served_cell(self, run: dict, source: str | None = None) -> str:
        counted = run["by_source"][source] if source else run
        per_request = counted.get("mean_request_acceptance_length")
        return (f"{counted['mean_acceptance_length']:.3f} / {f'{per_request:.3f}' if per_request is not None else '-'}"
                f" / {self.sim(self.report['drafts'][run['trainer']], source):.3f}")

    def served(self) -> list[str]:
        if not self.report.get("served"):
            return []
        lines = ["", f"## vLLM's own counters (06's serve, k={self.served_k}) against the simulation", "",
                 "Each cell: vLLM pooled (1 + accepted / drafts over the benchmark's requests) / mean of per-request "
                 "AL / simulated (docs/06_validate.md: which is which).", "",
                 *head(["draft", *self.sources, "all prompts"])]
        for name, run in self.report["served"].items():
            run = dict(run, trainer=name)
            cells = [self.served_cell(run, s) if s in run["by_source"] else "-" for s in self.sources]
            lines.append(row([name, *cells, self.served_cell(run)]))
        return lines

    def tail(self) -> list[str]:
        """Regeneration with the draft, the notes, the drafts that failed."""
        report, lines = self.report, []
        if report.get("regeneration"):
            lines += ["", "## Regeneration with the trained draft (01 on the same magpie conversations, 01's "
                      "concurrency)", "", *head(["run", "generated tokens", "tokens/s", "mean acceptance length"])]
            for name, run in report["regeneration"].items():
                generation = run["generation"] or {}
                speculative = generation.get("speculative") or {}
                lines.append(f"| {name} | {generation.get('tokens_generated')} | {generation.get('tokens_per_s')} | "
                             f"{speculative.get('mean_acceptance_length', '-')} |")
        if report.get("notes"):
            lines += ["", "## Notes", ""] + [f"- {note}" for note in report["notes"]]
        failed = {n: r["error"].splitlines()[-1][:200] for n, r in report["drafts"].items() if "error" in r}
        if failed:
            lines += ["", "## Failed", ""] + [f"- {n}: {e}" for n, e in failed.items()]
        return lines


def quality_gpu_markdown(report: dict) -> str:
    sections = GpuReport(report)
    lines = [*sections.head(), *sections.curve(), *sections.three_seeds(), *sections.targets(), *sections.levers(),
             *sections.served(), *sections.tail()]
    return "\n".join(lines) + "\n"


def quality_gpu_plot(report: dict, path: Path) -> None:
    from matplotlib.ticker import NullFormatter

    plt, k = pyplot(), report["k"]  # the k the bench serves and simulates at
    sources = sources_of(report)
    fig, axes = plt.subplots(1, len(sources) + 1, figsize=(4 * (len(sources) + 1), 3.6), sharex=True, squeeze=False)
    axes = axes[0]
    for ax, source in zip(axes, [None, *sources]):
        key = metric_key(k, source=source)
        for i, trainer in enumerate(("ours", "speculators")):
            points = sorted((r["train_tokens"], r["shared_eval"][key]) for n, r in report["drafts"].items()
                            if n.startswith(f"{trainer}-") and n.endswith("-s0") and "shared_eval" in r)
            if points:
                ax.plot(*zip(*points), marker="o", label=trainer, color=f"C{i}")
        for name, record in report["drafts"].items():  # the levers, one point each at the largest budget
            if not name.startswith(("ours-", "speculators-")) and "shared_eval" in record:
                point = (record["train_tokens"], record["shared_eval"][key])
                ax.scatter(*point, marker="x", color="gray")
                ax.annotate(name.rsplit("-", 2)[0], point, fontsize=6, color="gray")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set(title=source or "all prompts", xlabel="training tokens")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"simulated acceptance length, k={k}")
    axes[0].legend()
    save_figure(fig, path)


RENDERERS = {"quality": (quality_markdown, quality_plot), "quality_gpu": (quality_gpu_markdown, quality_gpu_plot)}


def render(name: str, result: Path) -> str:
    """Write RESULT's .md and .png beside it; returns the markdown."""
    markdown, plot = RENDERERS[name]
    report = json.loads(result.read_text())
    text = markdown(report)
    result.with_suffix(".md").write_text(text)
    plot(report, result.with_suffix(".png"))
    return text


if __name__ == "__main__":
    arguments = parser(__doc__)
    arguments.add_argument("name", choices=sorted(RENDERERS))
    arguments.add_argument("result", type=Path)
    args = arguments.parse_args()
    print(render(args.name, args.result))
