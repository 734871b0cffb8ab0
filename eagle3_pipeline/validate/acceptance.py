"""vLLM serving the target with the exported draft: acceptance counters, loaded weights, greedy outputs.

One engine per setting (k speculative tokens, or none), started with the run's engine settings
(`engine.start_engine`), fed the eval prompts as token ids, greedy. vLLM's spec-decode counters
(`LLM(disable_log_stats=False)`, `llm.get_metrics()`) give the acceptance:

    mean acceptance length   1 + accepted / drafts          (tokens per target forward pass)
    acceptance at position i accepted_per_pos[i] / drafts   (draft token i+1 accepted, the ones before it too)

Callers need a `__main__` guard: vLLM spawns its engine process.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from pathlib import Path

from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.engine import start_engine
from eagle3_pipeline.export_format import speculative_config
from eagle3_pipeline.validate.weights_probe import PROBE, REPORT, skipped_parameters
from eagle3_pipeline.vision import Prompt, Vision, request

COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class EngineRun:
    num_speculative_tokens: int  # 0: no speculation
    outputs: list[list[int]]  # generated token ids per prompt
    seconds: float
    counters: dict[str, int] = field(default_factory=dict)
    accepted_per_position: list[int] = field(default_factory=list)
    skipped_parameters: list[str] = field(default_factory=list)
    ignored_tensors: list[str] = field(default_factory=list)
    shared_parameters: list[str] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.counters["num_accepted_tokens"] / max(self.counters["num_drafts"], 1)

    @property
    def acceptance_per_position(self) -> list[float]:
        drafts = max(self.counters["num_drafts"], 1)
        return [accepted / drafts for accepted in self.accepted_per_position]

    @property
    def generated_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.outputs)


def serve(config: RunConfig, model_dir: Path, prompts: list[Prompt], export_dir: Path | None, k: int) -> EngineRun:
    """Generate greedily for every prompt (with its images), with the draft at k tokens (or without speculation
    when k == 0)."""
    from vllm import SamplingParams

    settings = {}
    if k:
        settings = {"speculative_config": speculative_config(export_dir, k), "worker_extension_cls": PROBE}
    llm = start_engine(config.target, model_dir, disable_log_stats=False, **settings)
    try:
        run = EngineRun(k, [], 0.0)
        if k:
            record_weights(run, llm.collective_rpc(REPORT))
        params = SamplingParams(temperature=0.0, max_tokens=config.validate_.max_tokens)
        started = time.perf_counter()
        vision = Vision.of_engine(llm, model_dir)
        requests = [request(ids, images, vision) for ids, images in prompts]
        results = llm.generate(requests, params, use_tqdm=False)
        run.seconds = time.perf_counter() - started
        run.outputs = [list(result.outputs[0].token_ids) for result in results]
        if k:
            read_counters(run, llm.get_metrics())
        return run
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def record_weights(run: EngineRun, reports: list[dict]) -> None:
    """Parameters any worker left unloaded (tensor parallel: each worker loads its own shard)."""
    for report in reports:
        skipped, ignored = skipped_parameters(report)
        run.skipped_parameters = sorted(set(run.skipped_parameters) | set(skipped))
        run.ignored_tensors = sorted(set(run.ignored_tensors) | set(ignored))
        run.shared_parameters = sorted(set(run.shared_parameters) | set(report["shared"]))


def read_counters(run: EngineRun, metrics: list) -> None:
    """The spec-decode counters of this engine (summed over label sets, e.g. engines)."""
    counters = dict.fromkeys(COUNTERS, 0)
    per_position = [0] * run.num_speculative_tokens
    for metric in metrics:
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in counters:
            counters[name] += int(metric.value)
        elif metric.name == PER_POSITION:
            per_position = [a + int(b) for a, b in zip(per_position, metric.values)]
    run.counters, run.accepted_per_position = counters, per_position
