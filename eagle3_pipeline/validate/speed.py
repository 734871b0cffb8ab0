"""Stage 06: how fast the target decodes with the draft and without it, as a user of the engine sees it.

Each engine of 06 runs the eval prompts twice: all at once (the eval batch, the acceptance run) and then the first
`validate.latency_prompts` of them one at a time (concurrency 1). Per phase: generated tokens/s (wall clock) and
per-request latency (vLLM's own request timestamps: time to the first token plus decode time).

At concurrency 1 two step times are measured, each on its own:
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
C - T - k·D, is what the prediction leaves out, in milliseconds per cycle (`unexplained_ms`).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field

START_DRAFT_TIMING = "start_draft_timing"
DRAFT_TIMING = "draft_timing"

_intervals: list[tuple] = []  # (start mark, end mark) per timed propose call in this worker process
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
    draft (`acceptance.EngineRun`) against the one without it (None when 06 ran none)."""
    k = run.num_speculative_tokens
    report = {
        "eval_batch": {"with_draft": run.batch.to_json(), "without_draft": plain.batch.to_json() if plain else None,
                       "measured_speedup": run.batch.tokens_per_s / plain.batch.tokens_per_s if plain else None},
        "concurrency_1": None,
    }
    single, plain_single = run.single, plain.single if plain else None
    if single is None:
        return report
    target_step = statistics.median(plain_single.timing.step_s) if plain_single and plain_single.timing.step_s else None
    draft_step = statistics.median(single.draft_rounds_s) / k if single.draft_rounds_s else None
    acceptance_length = single.mean_acceptance_length
    predicted = unexplained = None
    cycle = single.timing.decode_s / single.counts.drafts if single.counts.drafts else None
    if target_step and draft_step is not None:
        predicted = acceptance_length * target_step / (target_step + k * draft_step)
        unexplained = cycle - target_step - k * draft_step if cycle else None
    report["concurrency_1"] = {
        "with_draft": single.timing.to_json(),
        "without_draft": plain_single.timing.to_json() if plain_single else None,
        "mean_acceptance_length": acceptance_length,
        "num_drafts": single.counts.drafts,  # vLLM's counter over this phase
        "draft_rounds_timed": len(single.draft_rounds_s),
        "target_step_ms": target_step * 1e3 if target_step else None,
        "draft_step_ms": draft_step * 1e3 if draft_step is not None else None,
        "predicted_speedup": predicted,  # AL·T / (T + k·D)
        "cycle_ms": cycle * 1e3 if cycle else None,  # decode time with the draft / verifying steps
        "unexplained_ms": unexplained * 1e3 if unexplained is not None else None,  # cycle - T - k·D
        "measured_speedup": single.timing.tokens_per_s / plain_single.timing.tokens_per_s if plain_single else None,
    }
    return report


# --- in vLLM's worker processes ------------------------------------------------------------------------------
class DraftStepTimer:
    """Mixed into vLLM's worker class (06's worker extension): times the drafter's `propose` calls through
    `llm.collective_rpc(START_DRAFT_TIMING)` ... `llm.collective_rpc(DRAFT_TIMING)`."""

    def start_draft_timing(self) -> None:
        proposer = drafter(self.model_runner)
        if not getattr(proposer.propose, "timed", False):
            proposer.propose = _timed(proposer.propose)
        _intervals.clear()
        _recording[0] = True

    def draft_timing(self) -> list[float]:
        """Seconds of each propose call since `start_draft_timing`; stops recording."""
        import torch

        _recording[0] = False
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds = [start.elapsed_time(end) / 1e3 if hasattr(start, "elapsed_time") else end - start
                   for start, end in _intervals]
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


def _timed(propose):
    @functools.wraps(propose)
    def timed_propose(*args, **kwargs):
        if not _recording[0]:
            return propose(*args, **kwargs)
        start = _mark()
        result = propose(*args, **kwargs)
        _intervals.append((start, _mark()))
        return result

    timed_propose.timed = True
    return timed_propose
