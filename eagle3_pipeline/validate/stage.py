"""Stage 06: prove the export is what the config says, that vLLM loads all of it, and that it speeds the target up.

    static    each export folder against the spec the config implies (for Kimi: the AQ-MedAI reference's):
              every tensor name, shape, dtype and config field, d2t/t2d values; differences classified
              (compare.py). Any breaking one fails the stage before an engine starts.
    dynamic   vLLM with the target and the draft on 01's eval prompts, once per k: acceptance counters per eval
              source, each request's own acceptance length (request_steps.py) and the draft parameters vLLM
              loaded (weights_probe.py); once without speculation, for
              greedy outputs to compare. A train/serve mismatch (position-1 acceptance far below 04's eval
              step-0 accuracy), a parameter vLLM did not load, or a greedy output the draft changed where the
              target's margin is neither a bf16 near-tie (validate.max_tie_margin) nor within the target's own
              batch variance (the largest margin it flips a token at alone, one prompt at a time) fails the stage.
    speed     tokens/s and latency with and without the draft, at the eval batch and at each of
              validate.latency_concurrency, the parts of an engine step and the speed-up they predict beside the
              measured one (speed.py).

Writes report.json, report.md, acceptance.png; the manifest only when everything passed (a failed check
stays failed on rerun). `check` is the static comparison alone, on any folder or spec.json.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from eagle3_pipeline.acceptance import metric_key
from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.config_sections import ValidateConfig
from eagle3_pipeline.data.dataset import open_split
from eagle3_pipeline.export.format import Spec, read_spec, reference_spec, spec_format
from eagle3_pipeline.export.serving import serving_command
from eagle3_pipeline.stage_io import Stage, StageError, read_manifest
from eagle3_pipeline.target import target_path
from eagle3_pipeline.validate.acceptance import (
    CHANGED_BY_DRAFT,
    MAX_LOGPROBS,
    EngineRun,
    EvalPrompt,
    RequestCounted,
    batch_variance_margin,
    serve,
)
from eagle3_pipeline.validate.compare import BREAKING, Difference, ordered, static_differences
from eagle3_pipeline.validate.report import difference_table, print_summary, write_reports
from eagle3_pipeline.validate.speed import speed_report

# What serving an Eagle-3 draft on the target relies on (each reports "not needed" where vLLM needs no help)
REQUIRED_PATCHES = ("vllm-eagle3-deepseek-kimi", "vllm-eagle3-target-check")


def run(config: RunConfig, force: bool = False) -> None:
    """Stage 06: the static check of every exported format, then vLLM's acceptance on 01's eval prompts."""
    stage = Stage(config, "06_validate", force=force)
    if stage.is_complete():
        return
    stage.begin()
    export_dir = stage.input_dir("05_export")
    exported = read_manifest(export_dir)
    serving_len = config.target.engine.max_model_len

    # 1. Static: a breaking difference fails here, before minutes of engine start-up.
    with stage.timed("static"):
        static = {fmt: static_differences(export_dir / fmt, expected_spec(config, fmt, exported), serving_len)
                  for fmt in exported["formats"]}
    problems = [f"{fmt} {d.where}: {d.message}" for fmt, ds in static.items() for d in ds if d.kind == BREAKING]
    for fmt, differences in static.items():
        print(f"06_validate: static check of {fmt}: {len(differences)} differences\n{difference_table(differences)}")

    # 2. Dynamic: the first exported format served by vLLM, once per k, then once without speculation.
    served = export_dir / exported["formats"][0]
    eval_metrics = exported.get("eval_metrics") or {}
    step0 = eval_metrics.get("eval_accuracy", [None])[0]
    runs, plain, prompts = [], None, []
    if not problems:
        prompts = eval_prompts(config, stage.input_dir("01_data"))
        runs, plain = serve_all(stage, config, served, prompts)
        problems += dynamic_problems(runs, step0, config.validate_)
    else:
        print("06_validate: breaking differences: vLLM not started")

    report = build_report(config, served, static, runs, plain, prompts, eval_metrics, problems)
    write_reports(stage.dir, report)
    print_summary(report)
    if problems:
        raise StageError(f"validation failed ({len(problems)} problems): see {stage.path('report.md')}")
    stage.finish(counts={"prompts": len(prompts), "mean_acceptance_length": report["mean_acceptance_length"],
                         "mean_request_acceptance_length": report["mean_request_acceptance_length"]},
                 extra={"report": "report.json"})


def check(config: RunConfig, path: Path | None, reference: Path | None) -> None:
    """Static comparison only: `path` (default: the run's first export) against `reference` or the config's spec."""
    path = path or Path(config.run_dir) / "05_export" / config.export.formats[0]
    actual = read_spec(path)
    if reference:
        expected = read_spec(reference)
    else:
        expected = expected_spec(config, spec_format(actual.config), read_manifest(Path(config.run_dir) / "05_export"))
    differences = static_differences(path, expected, config.target.engine.max_model_len)
    against = reference or f"the spec of {config.run_dir}'s config"
    print(f"{path} against {against}: {len(differences)} differences\n{difference_table(differences)}")
    breaking = [d for d in ordered(differences) if d.kind == BREAKING]
    if breaking:
        raise StageError(f"{len(breaking)} breaking differences, first: {breaking[0].where}: {breaking[0].message}")


def expected_spec(config: RunConfig, fmt: str, exported: dict | None) -> Spec:
    """The spec an export folder must meet: the reference format's from the config; the speculators format's as
    05 recorded it (speculators' own serialisation, which this stage's environment cannot build)."""
    if fmt == "reference":
        return reference_spec(config)
    recorded = ((exported or {}).get("specs") or {}).get(fmt)
    if recorded is None:
        raise StageError(f"{config.run_dir}/05_export/manifest.json records no {fmt} spec: rerun 05_export.py "
                         "(--force), or compare against a spec with --reference")
    return Spec(recorded["config"], recorded["tensors"])


def eval_prompts(config: RunConfig, data_dir: Path | None = None) -> list[EvalPrompt]:
    """01's eval split, templated prompts (`prompt_ids`, one per served turn) with their source and images, the
    first `validate.max_prompts`."""
    data_dir = data_dir or Path(config.run_dir) / "01_data"
    if read_manifest(data_dir) is None or not (data_dir / "eval").is_dir():
        raise StageError(f"{data_dir} holds no finished eval split: rerun 01_prepare_data.py")
    split = open_split(data_dir, "eval")
    if "prompt_ids" not in split.column_names or len(split) == 0:
        raise StageError(f"01_data has no eval prompts ({data_dir}/eval), and 06 measures acceptance on them: set "
                         "data.eval_sources or data.eval_fraction, then rerun the stages from 01_prepare_data.py --force")
    chosen = split.select(range(min(len(split), config.validate_.max_prompts or len(split))))
    return [EvalPrompt(source, list(ids), list(images))
            for source, ids, images in zip(chosen["source"], chosen["prompt_ids"], chosen["images"])]


def serve_all(stage: Stage, config: RunConfig, served: Path, prompts: list[EvalPrompt]):
    """One engine per k with the draft, then one without speculation: (runs, plain or None)."""
    from patches import PatchError, require_applied

    try:
        require_applied(*REQUIRED_PATCHES)
    except PatchError as err:
        raise StageError(str(err)) from None
    model_dir = target_path(config.target)
    print(f"06_validate: {len(prompts)} eval prompts, up to {config.validate_.max_tokens} tokens, "
          f"k = {config.validate_.num_speculative_tokens}, draft {served}")
    if caveat := dtype_caveat(config, model_dir):
        print(caveat)
    runs, plain = [], None
    for k in config.validate_.num_speculative_tokens:
        with stage.timed(f"vllm_k{k}"):
            runs.append(serve(config, model_dir, prompts, served, k))
    if config.validate_.compare_without_speculation:
        with stage.timed("vllm_without_speculation"):
            plain = serve(config, model_dir, prompts, None, 0, compare_with=runs)
    return runs, plain


def dtype_caveat(config: RunConfig, model_dir: Path) -> str | None:
    """A line for engines run in another dtype (`validate.engine_dtype`) than the one 02 captured the draft's training
    states in: their acceptance is then the draft's on states it did not train on, not what 04 simulated (the
    learned Kimi stand-in: 1.85 in float16 against 2.04 in bf16; docs/06_validate.md)."""
    served, captured = config.validate_.engine_dtype, config.target.engine.dtype
    if served is None:  # the engines run in the capture's dtype
        return None
    if captured == "auto":
        checkpoint = json.loads((model_dir / "config.json").read_text())
        captured = checkpoint.get("dtype") or checkpoint.get("torch_dtype") or "the checkpoint's dtype"
    if served == captured:
        return None
    return (f"06_validate: engines in {served} (validate.engine_dtype), 02 captured the draft's training states in "
            f"{captured}: the acceptance measured here is the draft's on states it did not train on, not 04's "
            "simulated one")


def dynamic_problems(runs: list[EngineRun], step0: float | None, validate: ValidateConfig) -> list[str]:
    problems, ratio = [], validate.min_acceptance_ratio
    variance = batch_variance_margin([d for run in runs for d in run.divergences])
    for run in runs:
        tag = f"k={run.num_speculative_tokens}"
        if run.skipped_parameters:
            problems.append(f"{tag}: vLLM did not load these draft parameters from the export: {run.skipped_parameters}")
        if run.counts.drafts == 0:
            problems.append(f"{tag}: vLLM proposed no drafts: speculation did not run")
        elif step0 is not None and run.acceptance_per_position[0] < ratio * step0:
            problems.append(f"{tag}: train/serve mismatch: position-1 acceptance {run.acceptance_per_position[0]:.3f} "
                            f"< {ratio} x eval step-0 accuracy {step0:.3f} (check aux layer ids and their convention, "
                            "norm_before_residual, rope, d2t)")
        for d in run.divergences:
            if d.verdict(validate.max_tie_margin, variance) != CHANGED_BY_DRAFT:
                continue  # a bf16 near-tie, or within what the target moves alone under another batch shape: reported
            margin = (f"{d.margin:.3f} > validate.max_tie_margin {validate.max_tie_margin} and > the target's own "
                      f"batch variance {variance:.3f}" if d.margin_exact else
                      f"at least {d.margin:.3f} (a token outside its top {MAX_LOGPROBS})")
            problems.append(f"{tag}: the greedy output of eval prompt {d.prompt} ({d.source}) differs from the one "
                            f"without the draft at token {d.position} ({d.with_draft} instead of {d.without_draft}) "
                            f"where the target's logit margin is {margin}: the draft changed what the target writes")
    return problems


def build_report(config: RunConfig, served: Path, static: dict[str, list[Difference]], runs: list[EngineRun],
                 plain: EngineRun | None, prompts: list[EvalPrompt], eval_metrics: dict, problems: list[str]) -> dict:
    first = runs[0] if runs else None
    simulated = eval_metrics.get("simulated_acceptance") or {}
    variance = batch_variance_margin([d for run in runs for d in run.divergences])
    runs_json = [run_json(run, plain, simulated, config.validate_.max_tie_margin, variance) for run in runs]
    return {
        "export": str(served),
        "verdict": "FAILED" if problems else "PASSED",
        "problems": problems,
        "num_speculative_tokens": first.num_speculative_tokens if first else None,
        "mean_acceptance_length": first.mean_acceptance_length if first else None,
        "mean_request_acceptance_length": first.mean_request_acceptance_length if first else None,
        "acceptance_per_position": first.acceptance_per_position if first else None,
        "greedy_identical_fraction": runs_json[0]["greedy_identical_fraction"] if runs_json else None,
        "eval_step0_accuracy": eval_metrics.get("eval_accuracy", [None])[0],
        "min_acceptance_ratio": config.validate_.min_acceptance_ratio,
        "max_tie_margin": config.validate_.max_tie_margin,
        "batch_variance_margin": variance,  # the largest margin the target alone flips a token at (acceptance.py)
        "prompts": len(prompts),
        "max_tokens": config.validate_.max_tokens,
        "runs": runs_json,
        "by_source": by_source(prompts, runs, simulated),
        "without_speculation": {"tokens_per_s": plain.batch.tokens_per_s} if plain else None,
        "static_differences": {fmt: [d.to_json() for d in ds] for fmt, ds in static.items()},
        "serving_command": serving_command(config, served, first.num_speculative_tokens if first else None),
    }


def by_source(prompts: list[EvalPrompt], runs: list[EngineRun], simulated: dict[str, float]) -> dict:
    """Per eval source and k: vLLM's acceptance, and 04's simulated one (its metric keys) where recorded."""
    report = {}
    for source in dict.fromkeys(p.source for p in prompts):
        report[source] = {"prompts": sum(p.source == source for p in prompts), "runs": []}
        for run in runs:
            counts, k = run.by_source[source], run.num_speculative_tokens
            report[source]["runs"].append({
                "num_speculative_tokens": k,
                **acceptance_lengths(counts),
                "acceptance_per_position": counts.acceptance_per_position,
                "num_drafts": counts.counts.drafts,
                "simulated_mean_acceptance_length": simulated.get(metric_key(k, source=source)),
                "simulated_acceptance_per_position": [simulated.get(metric_key(k, i, source)) for i in range(1, k + 1)],
            })
    return report


def acceptance_lengths(counted: RequestCounted) -> dict:
    """The two mean acceptance lengths of the eval batch, or one source of it, and what each is taken over."""
    return {
        "mean_acceptance_length": counted.mean_acceptance_length,  # pooled: 1 + accepted / drafts, vLLM's counters
        "mean_request_acceptance_length": counted.mean_request_acceptance_length,  # mean of each request's own
        "requests_verified": sum(1 for r in counted.requests if r.verify_steps),  # the requests in that mean
        "num_verify_steps": sum(r.verify_steps for r in counted.requests),  # equals num_drafts (request_steps.py)
        "generated_tokens": sum(sum(r.tokens_per_step) for r in counted.requests),
    }


def run_json(run: EngineRun, plain: EngineRun | None, simulated: dict[str, float], max_tie_margin: float,
             batch_variance: float) -> dict:
    identical = None
    if plain is not None:
        identical = sum(a == b for a, b in zip(run.outputs, plain.outputs)) / max(len(run.outputs), 1)
    speed = speed_report(run, plain)
    return {
        "num_speculative_tokens": run.num_speculative_tokens,
        **acceptance_lengths(run),
        "acceptance_per_position": run.acceptance_per_position,
        "simulated_mean_acceptance_length": simulated.get(metric_key(run.num_speculative_tokens)),  # 04's eval
        **run.counts.vllm_counters(),
        "accepted_per_position": run.counts.accepted_per_position,
        "greedy_identical_fraction": identical,
        # each prompt whose greedy output differs from the one without the draft (acceptance.Divergence)
        "divergences": [asdict(d) | {"verdict": d.verdict(max_tie_margin, batch_variance)} for d in run.divergences],
        "tokens_per_s": run.batch.tokens_per_s,
        "speedup": speed["eval_batch"]["measured_speedup"],  # tokens/s against the same prompts without the draft
        "speed": speed,  # both phases: tokens/s, latency, step times, predicted speed-up (speed.py)
        "loaded_parameters": run.loaded_parameters,  # the draft parameters vLLM loaded from the export
        "skipped_parameters": run.skipped_parameters,
        "shared_from_target": run.shared_parameters,
        "ignored_tensors": run.ignored_tensors,
    }
