"""vLLM serving the target with the exported draft: acceptance counters, loaded weights, greedy outputs.

One engine per setting (k speculative tokens, or none), started with the run's engine settings
(`engine.start_engine`), fed the eval prompts as token ids, greedy, one eval source after the other. vLLM's
spec-decode counters (`LLM(disable_log_stats=False)`, `llm.get_metrics()`), read after each source, give the
acceptance per source and overall:

    mean acceptance length   1 + accepted / drafts          (tokens per target forward pass)
    acceptance at position i accepted_per_pos[i] / drafts   (draft token i+1 accepted, the ones before it too)

as `eagle3_pipeline.acceptance.AcceptanceCounts`, the type 04's simulation produces too. Beside these pooled
figures, the eval batch records the tokens each engine step emitted per request (request_steps.py): the mean
over requests of each request's own acceptance length.

Then the first `validate.latency_prompts` prompts run again in groups of each `validate.latency_concurrency` (one
at a time at 1), for latency and step times at that concurrency (speed.py).

Callers need a `__main__` guard: vLLM spawns its engine process.
"""

from __future__ import annotations

import gc
import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.acceptance import AcceptanceCounts, read_counters
from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.data.vision import Vision, request
from eagle3_pipeline.engine import speculative_config, start_engine
from eagle3_pipeline.validate.request_steps import (
    RequestSteps,
    mean_request_acceptance_length,
    recorded_steps,
    request_steps,
)
from eagle3_pipeline.validate.speed import ENGINE_STEP_CALLS, ON_HOST, START_STEP_TIMING, STEP_TIMING, Timing
from eagle3_pipeline.validate.weights_probe import (
    REPORT,
    flagged_norms,
    left_at_init,
    loaded_parameters,
    skipped_parameters,
)
from eagle3_pipeline.validate.worker import WORKER_EXTENSION


@dataclass(frozen=True)
class EvalPrompt:
    """One served turn of 01's eval split."""

    source: str  # the eval source's label (01's `source` column)
    token_ids: list[int]  # as 01 stores them: image placeholders expanded
    images: list[bytes] = ()  # the images' file bytes (vision.request hands them to vLLM)


class Counted:
    """A run, or a part of one, with vLLM's spec-decode counts over it."""

    counts: AcceptanceCounts

    @property
    def mean_acceptance_length(self) -> float:
        return self.counts.mean_acceptance_length

    @property
    def acceptance_per_position(self) -> list[float]:
        return self.counts.acceptance_per_position


class RequestCounted(Counted):
    """A run, or a part of one, with each request's engine steps besides vLLM's counts."""

    requests: list[RequestSteps]

    @property
    def mean_request_acceptance_length(self) -> float | None:
        return mean_request_acceptance_length(self.requests)


@dataclass
class SourceCounts(RequestCounted):
    """One eval source's prompts: vLLM's spec-decode counts (the difference of two readings), each request's steps."""

    counts: AcceptanceCounts
    requests: list[RequestSteps]


@dataclass
class Divergence:
    """Where a greedy output with the draft first differs from the one without it, and the target's margin there."""

    prompt: int  # index into the eval prompts
    source: str
    position: int  # first differing generated token
    without_draft: int  # the token each run wrote there
    with_draft: int
    # log p(without_draft) - log p(with_draft) at that position, from a fresh prefill of the common prefix (a logit
    # difference); a token outside the top MAX_LOGPROBS counts at the lowest of them (margin_exact false)
    margin: float
    margin_exact: bool
    # where the target alone, one request at a time and without the draft, first departs from its batched output
    # on this prompt (None: it writes the same), and the margin there between the batched token and its own (probed
    # like `margin`): a sample of how far the target moves by itself when only the batch shape changes
    alone_departs_at: int | None = None
    alone_margin: float | None = None  # None: no departure, or a token outside the top MAX_LOGPROBS

    def verdict(self, max_tie_margin: float, batch_variance_margin: float = 0.0) -> str:
        """NEAR_TIE (the target's margin within validate.max_tie_margin), BATCH_VARIANCE (the target's own batch
        variance: a fresh prefill prefers the token written with the draft, the target alone flips this very token,
        or the margin is within `batch_variance_margin`, the largest the target alone flips at on these prompts)
        or CHANGED_BY_DRAFT, the one that fails 06."""
        if self.margin_exact and abs(self.margin) <= max_tie_margin:
            return NEAR_TIE
        # a negative margin lands here too: the fresh prefill prefers the token written with the draft
        if self.margin_exact and self.margin <= batch_variance_margin:
            return BATCH_VARIANCE
        if self.alone_departs_at == self.position:
            return BATCH_VARIANCE
        return CHANGED_BY_DRAFT


def batch_variance_margin(divergences: list[Divergence]) -> float:
    """The largest margin at which the target alone, without the draft, flips a token of its batched output on
    these prompts: what the target's numerics move by themselves when only the batch shape changes (an MoE router
    in bf16 picks other experts; 0.0 when the target never flips alone)."""
    return max((abs(d.alone_margin) for d in divergences if d.alone_margin is not None), default=0.0)


NEAR_TIE, BATCH_VARIANCE, CHANGED_BY_DRAFT = "bf16 near-tie", "the target's own batch variance", "changed by the draft"


@dataclass
class GroupedRequests(Counted):
    """One timed phase (the eval batch, or the prompts in groups of one concurrency): its timing, spec-decode counts,
    the worker's timed calls and each group's requests' engine steps."""

    timing: Timing
    counts: AcceptanceCounts
    worker_s: dict[str, list[float]]  # seconds of each timed worker call in the decode steps, by name (speed.py)
    groups: list[list[RequestSteps]]  # per `llm.generate` call (submitted at once), each request's steps

    @property
    def decode_steps(self) -> list[int]:
        """Per group: its engine steps once every request of it has its first token (its prefills done), counted
        as the steps its slowest request still emitted at: one per token without a draft, one per verifying step
        with it. At one request a group: generated tokens - 1, or its verifying steps."""
        steps = []
        for group in filter(None, self.groups):
            prefilled = max(r.step_indices[0] for r in group)
            steps.append(max(sum(index > prefilled for index in r.step_indices) for r in group))
        return steps

    @property
    def engine_steps_s(self) -> list[float]:
        """Seconds of each engine step in the worker: the verifying forward, then sampling, rejection and the next
        drafting round (the model runner's `execute_model` + `sample_tokens`, call by call)."""
        return self._steps("")

    @property
    def host_engine_steps_s(self) -> list[float]:
        """The same on the host's clock (timed on a GPU only)."""
        return self._steps(ON_HOST)

    def _steps(self, clock: str) -> list[float]:
        return [sum(calls) for calls in zip(*(self.worker_s.get(name + clock, []) for name in ENGINE_STEP_CALLS))]


@dataclass
class EngineRun(RequestCounted):
    num_speculative_tokens: int  # 0: no speculation
    outputs: list[list[int]]  # generated token ids per prompt
    batch: Timing  # the eval batch: every prompt of a source at once
    # by concurrency: the first validate.latency_prompts prompts in groups of validate.latency_concurrency
    grouped: dict[int, GroupedRequests] = field(default_factory=dict)
    counts: AcceptanceCounts = field(default_factory=lambda: AcceptanceCounts(0))  # over the eval batch
    by_source: dict[str, SourceCounts] = field(default_factory=dict)
    divergences: list[Divergence] = field(default_factory=list)  # against the run without speculation
    loaded_parameters: list[str] = field(default_factory=list)  # what vLLM's loader filled from the export
    skipped_parameters: list[str] = field(default_factory=list)
    ignored_tensors: list[str] = field(default_factory=list)
    shared_parameters: list[str] = field(default_factory=list)
    batch_worker_s: dict[str, list[float]] = field(default_factory=dict)  # the worker's timed decode steps, batch

    @property
    def batch_phase(self) -> GroupedRequests:
        """The eval batch as a timed phase: each eval source's prompts were one group."""
        return GroupedRequests(self.batch, self.counts, self.batch_worker_s,
                               [source.requests for source in self.by_source.values()])

    @property
    def generated_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.outputs)

    @property
    def requests(self) -> list[RequestSteps]:
        """Every eval prompt's steps, source after source."""
        return [steps for source in self.by_source.values() for steps in source.requests]


MAX_LOGPROBS = 20  # vLLM's default max_logprobs: the divergence probe's top tokens


def serve(config: RunConfig, model_dir: Path, prompts: list[EvalPrompt], export_dir: Path | None, k: int,
          compare_with: list[EngineRun] = ()) -> EngineRun:
    """Generate greedily for every prompt (with its images), with the draft at k tokens (or without speculation
    when k == 0), one eval source after the other so that each has its own counters; for each run in
    `compare_with`, find where its outputs first differ from these and probe the target's margin there
    (`Divergence`)."""
    from vllm import SamplingParams

    settings = {"dtype": config.validate_.engine_dtype} if config.validate_.engine_dtype else {}
    if k:
        settings["speculative_config"] = speculative_config(export_dir, k)
    text_only = not any(prompt.images for prompt in prompts)  # no vision tower to load or profile
    llm = start_engine(config.target, model_dir, text_only=text_only, disable_log_stats=False,
                       worker_extension_cls=WORKER_EXTENSION, **settings)
    try:
        largest_source = max(Counter(p.source for p in prompts).values(), default=0)  # submitted at once
        run = EngineRun(k, [[] for _ in prompts], Timing(concurrency=largest_source))
        if k:
            config_json = json.loads((export_dir / "config.json").read_text())
            record_weights(run, llm.collective_rpc(REPORT), flagged_norms(config_json), left_at_init(config_json))
        params = SamplingParams(temperature=0.0, max_tokens=config.validate_.max_tokens)
        vision = None if text_only else Vision.of_engine(llm, model_dir)
        for source in dict.fromkeys(p.source for p in prompts):
            indices = [i for i, p in enumerate(prompts) if p.source == source]
            requests = [request(prompts[i].token_ids, prompts[i].images, vision) for i in indices]
            results, run.by_source[source] = generate_counted(llm, requests, params, k, run.batch,
                                                              run.batch_worker_s)
            for i, result in zip(indices, results):
                run.outputs[i] = list(result.outputs[0].token_ids)
        run.counts = sum((c.counts for c in run.by_source.values()), AcceptanceCounts(k))
        for concurrency in config.validate_.latency_concurrency if config.validate_.latency_prompts else ():
            chosen = prompts[:max(config.validate_.latency_prompts, concurrency)]
            run.grouped[concurrency] = in_groups(llm, vision, chosen, params, k, concurrency)
        for other in compare_with:
            other.divergences = probe_divergences(llm, vision, prompts, run.outputs, other.outputs, params)
        return run
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate_counted(llm, requests: list[dict], params, k: int, timing: Timing,
                     worker_s: dict[str, list[float]]) -> tuple[list, SourceCounts]:
    """`llm.generate` on the requests at once, timed into `timing` and, in the worker, into `worker_s` (its decode
    steps): its RequestOutputs, and vLLM's spec-decode counts over them with each request's engine steps."""
    before = read_counters(llm.get_metrics(), k)
    llm.collective_rpc(START_STEP_TIMING)
    with recorded_steps(llm) as emitted:
        started = time.perf_counter()
        results = llm.generate(requests, params, use_tqdm=False)
        timing.add(results, time.perf_counter() - started)
    for name, seconds in llm.collective_rpc(STEP_TIMING)[0].items():  # tensor parallel: ranks step alike; rank 0's
        worker_s.setdefault(name, []).extend(seconds)
    counts = read_counters(llm.get_metrics(), k) - before
    return results, SourceCounts(counts, request_steps(results, emitted))


def in_groups(llm, vision: Vision | None, prompts: list[EvalPrompt], params, k: int,
              concurrency: int) -> GroupedRequests:
    """The prompts `concurrency` at a time, each group one `llm.generate` call: timing, the phase's spec-decode
    counters, the worker's timed engine steps and drafting rounds."""
    phase = GroupedRequests(Timing(concurrency=concurrency), AcceptanceCounts(k), {}, [])
    for first in range(0, len(prompts), concurrency):
        group = [request(prompt.token_ids, prompt.images, vision) for prompt in prompts[first:first + concurrency]]
        _, counted = generate_counted(llm, group, params, k, phase.timing, phase.worker_s)
        phase.counts += counted.counts
        phase.groups.append(counted.requests)
    return phase


def probe_divergences(llm, vision: Vision | None, prompts: list[EvalPrompt], plain: list[list[int]],
                      drafted: list[list[int]], params) -> list[Divergence]:
    """Each prompt whose drafted output differs from the plain one: the first differing position, the target's
    log-probability margin between the two tokens there on the common prefix, and where the target alone (the
    prompt by itself, greedy `params`) departs from its batched output, with the target's margin there."""
    found = []
    for index, (a, b) in enumerate(zip(plain, drafted)):
        position = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if position is not None:
            found.append((index, position, a[position], b[position]))
    if not found:
        return []
    alone = [list(llm.generate([request(prompts[index].token_ids, prompts[index].images, vision)], params,
                                use_tqdm=False)[0].outputs[0].token_ids) for index, _, _, _ in found]
    departs = [first_difference(plain[index], own) for (index, _, _, _), own in zip(found, alone)]
    # the target's own flips: where it alone leaves its batched output (not where one output merely ends first)
    flips = [(index, at, plain[index][at], own[at]) for (index, _, _, _), own, at in zip(found, alone, departs)
             if at is not None and at < min(len(plain[index]), len(own))]
    margins = probe_margins(llm, vision, prompts, plain, found + flips)
    flip_margins = {index: margin for (index, _, _, _), margin in zip(flips, margins[len(found):])}
    divergences = []
    for (index, position, without, with_draft), (margin, exact), at in zip(found, margins, departs):
        alone_margin, alone_exact = flip_margins.get(index, (None, False))
        divergences.append(Divergence(index, prompts[index].source, position, without, with_draft, margin, exact,
                                      alone_departs_at=at, alone_margin=alone_margin if alone_exact else None))
    return divergences


def probe_margins(llm, vision: Vision | None, prompts: list[EvalPrompt], plain: list[list[int]],
                  probes: list[tuple[int, int, int, int]]) -> list[tuple[float, bool]]:
    """For each (prompt, position, token a, token b): log p(a) - log p(b) on a fresh prefill of the prompt and the
    plain output before `position`, and whether both tokens were in the top MAX_LOGPROBS (else the one outside
    counts at the lowest of them)."""
    from vllm import SamplingParams

    probe = SamplingParams(temperature=0.0, max_tokens=1, logprobs=MAX_LOGPROBS)
    requests = [request(prompts[i].token_ids + plain[i][:position], prompts[i].images, vision)
                for i, position, _, _ in probes]
    margins = []
    for (_, _, a, b), result in zip(probes, llm.generate(requests, probe, use_tqdm=False)):
        logprobs = {token: lp.logprob for token, lp in result.outputs[0].logprobs[0].items()}
        floor = min(logprobs.values())  # a token outside the top ones has at most this
        margins.append((logprobs.get(a, floor) - logprobs.get(b, floor), a in logprobs and b in logprobs))
    return margins


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (one ending before the other counts); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def record_weights(run: EngineRun, reports: list[dict], required: list[str], initialised: list[str] = ()) -> None:
    """Parameters the workers loaded, and those any worker left unloaded (tensor parallel: each worker loads its
    own shard), `required` ones (the norms the export's config turns on) included even where vLLM did not build
    them, `initialised` ones (`left_at_init`) not."""
    for report in reports:
        skipped, ignored = skipped_parameters(report, required, initialised)
        run.loaded_parameters = sorted(set(run.loaded_parameters) | set(loaded_parameters(report)))
        run.skipped_parameters = sorted(set(run.skipped_parameters) | set(skipped))
        run.ignored_tensors = sorted(set(run.ignored_tensors) | set(ignored))
        run.shared_parameters = sorted(set(run.shared_parameters) | set(report["shared"]))
