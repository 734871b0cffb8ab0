"""Stage 06: how fast the target decodes with the draft and without it, as a user of the engine sees it.

Each engine of 06 runs the eval prompts twice: all at once (the eval batch, the acceptance run) and then the first
`validate.latency_prompts` of them in groups of each `validate.latency_concurrency` (1: one at a time). Per phase:
generated tokens/s (wall clock) and per-request latency (vLLM's own request timestamps: time to the first token plus
decode time).

At each such concurrency two step times are measured, each on its own:
- the target step T: the decode time per generated token of the engine without the draft (one target forward,
  scheduling and sampling included);
- the draft step D: each call of the drafter's `propose` (k draft forwards, one round) is timed in the worker,
  with CUDA events on a GPU, and D = its median / k.

With the acceptance length AL of that phase, decoding with the draft takes T + k·D (one verifying target step
and k draft steps) per AL tokens, against T per token without it: the predicted speed-up is AL·T / (T + k·D),
reported beside the measured one. The verifying step checks k+1 tokens per request; at concurrency 1 that costs
about what one decode step does, so the two agree unless the engine spends time elsewhere (rejection sampling,
the draft's prefill, scheduling). That elsewhere is measured too: the cycle C, the decode time with the draft
over its verifying steps (vLLM's draft counter: one per verifying step of a request), against T + k·D; the rest,
C - T - k·D, is what the prediction leaves out, in milliseconds per cycle (`unexplained_ms`). The worker also
times the model runner's engine steps (`execute_model` + `sample_tokens`: the verifying forward, sampling,
rejection and the next drafting round), which splits the cycle into the verifying part (engine step - k·D) and
the time outside the worker's step (C - engine step: scheduling, the engine's messages, output processing).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field

START_DRAFT_TIMING = "start_draft_timing"
DRAFT_TIMING = "draft_timing"
# what the worker times, by name: the drafter's round, and the model runner's two halves of an engine step (the
# verifying forward, then sampling, rejection and, in vLLM's runners, the next drafting round)
PROPOSE, ENGINE_STEP_CALLS = "propose", ("execute_model", "sample_tokens")

_intervals: dict[str, list[tuple]] = {}  # name -> (start mark, end mark) per timed call in this worker process
_recording = [False]


@dataclass
class Timing:
    """One phase of an engine run: its requests' generated tokens, wall time and per-request timestamps."""

    concurrency: int  # requests submitted at once: the largest eval source's prompts, or 1
    generated_tokens: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)  # per request: first-token latency + decode time
    step_s: list[float] = field(default_factory=list)  # per request: decode time / (generated tokens - 1)
    decode_s: float = 0.0  # decode time summed over requests (first token to last)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def add(self, results: list, seconds: float) -> None:
        """The RequestOutputs of one `llm.generate` call that took `seconds`."""
        self.seconds += seconds
        for result in results:
            tokens = len(result.outputs[0].token_ids)
            self.generated_tokens += tokens
            stats = result.metrics  # vLLM's RequestStateStats (the engine logs stats: disable_log_stats=False)
            decode = stats.last_token_ts - stats.first_token_ts
            self.decode_s += decode
            self.latencies_s.append(stats.first_token_latency + decode)
            if tokens > 1:
                self.step_s.append(decode / (tokens - 1))

    def to_json(self) -> dict:
        return {"concurrency": self.concurrency, "requests": len(self.latencies_s), "tokens_per_s": self.tokens_per_s,
                "latency_s_mean": statistics.fmean(self.latencies_s) if self.latencies_s else None,
                "latency_s_p50": quantile(self.latencies_s, 0.5), "latency_s_p90": quantile(self.latencies_s, 0.9)}


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def speed_report(run, plain) -> dict:
    """Tokens/s, latency, step times and the predicted against the measured speed-up of one engine run with the
    draft (`acceptance.EngineRun`) against the one without it (None when 06 ran none): at the eval batch, and at
    each concurrency of `validate.latency_concurrency` (by its value, as a string key)."""
    return {
        "eval_batch": {"with_draft": run.batch.to_json(), "without_draft": plain.batch.to_json() if plain else None,
                       "measured_speedup": run.batch.tokens_per_s / plain.batch.tokens_per_s if plain else None},
        "by_concurrency": {str(concurrency): grouped_speed(group, plain.grouped.get(concurrency) if plain else None,
                                                           run.num_speculative_tokens)
                           for concurrency, group in run.grouped.items()},
    }


def grouped_speed(group, plain_group, k: int) -> dict:
    """One concurrency's figures: T from the run without the draft, D, the cycle and its split from the run with it."""
    target_step = statistics.median(plain_group.timing.step_s) if plain_group and plain_group.timing.step_s else None
    draft_step = statistics.median(group.draft_rounds_s) / k if group.draft_rounds_s else None
    acceptance_length = group.mean_acceptance_length
    predicted = unexplained = None
    cycle = group.timing.decode_s / group.counts.drafts if group.counts.drafts else None
    engine_step = statistics.median(group.engine_steps_s) if group.engine_steps_s else None
    if target_step and draft_step is not None:
        predicted = acceptance_length * target_step / (target_step + k * draft_step)
        unexplained = cycle - target_step - k * draft_step if cycle else None
    return {
        "with_draft": group.timing.to_json(),
        "without_draft": plain_group.timing.to_json() if plain_group else None,
        "mean_acceptance_length": acceptance_length,
        "num_drafts": group.counts.drafts,  # vLLM's counter over this phase
        "draft_rounds_timed": len(group.draft_rounds_s),
        "engine_steps_timed": len(group.engine_steps_s),
        "target_step_ms": target_step * 1e3 if target_step else None,
        "draft_step_ms": draft_step * 1e3 if draft_step is not None else None,
        "predicted_speedup": predicted,  # AL·T / (T + k·D)
        "cycle_ms": cycle * 1e3 if cycle else None,  # decode time with the draft / verifying steps
        "unexplained_ms": unexplained * 1e3 if unexplained is not None else None,  # cycle - T - k·D
        # the cycle split at the worker: its engine step (verifying forward, sampling, rejection, the next drafting
        # round), of which the verifying part is what k·D leaves, and the time outside the worker's step
        "engine_step_ms": engine_step * 1e3 if engine_step else None,
        "verify_ms": (engine_step - k * draft_step) * 1e3 if engine_step and draft_step is not None else None,
        "outside_step_ms": (cycle - engine_step) * 1e3 if cycle and engine_step else None,
        "measured_speedup": group.timing.tokens_per_s / plain_group.timing.tokens_per_s if plain_group else None,
    }


# --- in vLLM's worker processes ------------------------------------------------------------------------------
class DraftStepTimer:
    """Mixed into vLLM's worker class (06's worker extension): times the drafter's `propose` calls and the model
    runner's engine steps through `llm.collective_rpc(START_DRAFT_TIMING)` ... `llm.collective_rpc(DRAFT_TIMING)`."""

    def start_draft_timing(self) -> None:
        timed = [(drafter(self.model_runner), PROPOSE)]
        runner = self.model_runner
        timed += [(runner, name) for name in ENGINE_STEP_CALLS if callable(getattr(runner, name, None))]
        for owner, name in timed:
            if not getattr(getattr(owner, name), "timed", False):
                setattr(owner, name, _timed(getattr(owner, name), name))
        _intervals.clear()
        _recording[0] = True

    def draft_timing(self) -> dict[str, list[float]]:
        """Seconds of each timed call since `start_draft_timing`, by name (`propose`, `execute_model`,
        `sample_tokens`); stops recording."""
        import torch

        _recording[0] = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = {name: [start.elapsed_time(end) / 1e3 if hasattr(start, "elapsed_time") else end - start
                          for start, end in marks] for name, marks in _intervals.items()}
        _intervals.clear()
        return seconds


def drafter(runner):
    """The object whose `propose` runs one drafting round: Model Runner V2's `speculator`, V1's `drafter`."""
    proposer = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
    if proposer is None or not callable(getattr(proposer, "propose", None)):
        raise RuntimeError(f"draft step timer: {type(runner).__name__} has no speculator or drafter with a propose "
                           "method: this engine runs no speculation")
    return proposer


def _mark():
    """A point in time on the device's stream (a CUDA event), or the host clock where there is no GPU."""
    import torch

    if torch.cuda.is_available():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _timed(call, name: str):
    @functools.wraps(call)
    def timed_call(*args, **kwargs):
        if not _recording[0]:
            return call(*args, **kwargs)
        start = _mark()
        result = call(*args, **kwargs)
        _intervals.setdefault(name, []).append((start, _mark()))
        return result

    timed_call.timed = True
    return timed_call
