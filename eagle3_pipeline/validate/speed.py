"""Stage 06: how fast the target decodes with the draft and without it, as a user of the engine sees it, and a model
that predicts that speed-up from the parts of an engine step, each measured on its own.

Each engine of 06 runs the eval prompts twice: all at once (the eval batch, the acceptance run) and then the first
`validate.latency_prompts` of them in groups of each `validate.latency_concurrency` (1: one at a time). Per phase:
generated tokens/s (wall clock) and per-request latency (vLLM's own request timestamps: time to the first token plus
decode time); the measured speed-up is the ratio of the two engines' tokens/s.

The model. A group of requests submitted at once takes a fixed time (its prefills, the engine's handling of its
requests and, with the draft, the draft's first round over the prompts), then its decode steps, counted once every
request of it has its first token: without the draft one target step T per token of its longest output, with it
one cycle per verifying step of its slowest request (vLLM's per-step outputs, request_steps.py), where

    cycle = verify forward (k+1 tokens a request) + k·D (draft steps) + sampling and rejection + outside the step

Each part is timed in the worker of the engine it belongs to, over decode steps only (06's worker extension wraps
the model runner's `execute_model`, the verifying forward; `sample_tokens`, which samples, rejects and runs the
drafter's `propose`, k draft forwards; CUDA events on a GPU, the host clock on CPU). The time outside the worker's
step (scheduling, the engine's messages, output processing) is taken from the engine without the draft: T less
its worker step on the host's clock. The host runs the engine's loop; on a GPU the engine without a draft schedules
the next step while the device still runs this one, so its worker step on the device's clock overlaps the time
outside it, and T less that step leaves the outside out (0.02 of 0.55 ms on an H100, bench/results/README.md);
the engine with the draft waits for its rejection sampler each step and pays the outside in full. So no part comes
from the decode time with the draft, which checks the model: the measured cycle
(each group's decode span with the draft over its decode steps) is reported beside the model's, and the measured
speed-up beside the predicted one. `StepCosts` and `predicted_speedup` take other step costs as well (another
target's, counted from its bytes).
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import dataclass, field

START_STEP_TIMING = "start_step_timing"
STEP_TIMING = "step_timing"
# what the worker times, by name: the model runner's two halves of an engine step (the verifying forward, then
# sampling, rejection and, in vLLM's runners, the next drafting round) and the drafter's round within the second
VERIFY_FORWARD, SAMPLE_AND_DRAFT, PROPOSE = "execute_model", "sample_tokens", "propose"
ENGINE_STEP_CALLS = (VERIFY_FORWARD, SAMPLE_AND_DRAFT)
IN_PREFILL = "@prefill"  # a call in a step that prefills is kept apart under its name and this suffix
# on a GPU each call is also timed on the host clock, under its name and this suffix: the device's time leaves out
# what the host spends where the host, not the device, sets the pace
ON_HOST = "@host"

_intervals: dict[str, list[tuple]] = {}  # name -> (start mark, end mark) per timed call in this worker process
_recording = [False]
_decode_step = [False]  # whether the engine step under way (its `execute_model` call) only decodes
_host_too = [False]  # the device has its own clock (CUDA events): time each call on the host clock as well


@dataclass
class Timing:
    """One phase of an engine run: its requests' generated tokens, wall time and per-request timestamps."""

    concurrency: int  # requests submitted at once: the largest eval source's prompts, or 1
    generated_tokens: int = 0
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)  # per request: first-token latency + decode time
    first_token_s: list[float] = field(default_factory=list)  # per request: first-token latency
    # per `llm.generate` call: from its requests' last first token (every prefill done) to its last token
    decode_spans_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    def add(self, results: list, seconds: float) -> None:
        """The RequestOutputs of one `llm.generate` call that took `seconds`."""
        self.seconds += seconds
        if results:
            self.decode_spans_s.append(max(result.metrics.last_token_ts for result in results)
                                       - max(result.metrics.first_token_ts for result in results))
        for result in results:
            self.generated_tokens += len(result.outputs[0].token_ids)
            stats = result.metrics  # vLLM's RequestStateStats (the engine logs stats: disable_log_stats=False)
            self.first_token_s.append(stats.first_token_latency)
            self.latencies_s.append(stats.first_token_latency + stats.last_token_ts - stats.first_token_ts)

    def to_json(self) -> dict:
        return {"concurrency": self.concurrency, "requests": len(self.latencies_s), "tokens_per_s": self.tokens_per_s,
                "latency_s_mean": statistics.fmean(self.latencies_s) if self.latencies_s else None,
                "latency_s_p50": quantile(self.latencies_s, 0.5), "latency_s_p90": quantile(self.latencies_s, 0.9),
                "first_token_s_mean": statistics.fmean(self.first_token_s) if self.first_token_s else None}


def quantile(values: list[float], q: float) -> float | None:
    """The q-quantile by linear interpolation between the closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class StepCosts:
    """Seconds of each part of one engine step with the draft (one verifying step of every running request)."""

    verify_forward: float  # the target's forward over k+1 tokens a request
    draft_step: float  # one draft forward: a drafting round / k
    sample: float  # sampling, rejection sampling and the step's bookkeeping
    outside: float  # the engine's time outside the worker's step: scheduling, messages, output processing

    def cycle(self, k: int) -> float:
        return self.verify_forward + k * self.draft_step + self.sample + self.outside


def predicted_speedup(costs: StepCosts, k: int, target_step: float, fixed: float, plain_fixed: float,
                      plain_decode_steps: list[float], decode_steps: list[float]) -> float:
    """Wall time without the draft over wall time with it, group by group (requests submitted at once). A group
    takes a fixed time before it decodes (`plain_fixed` without the draft, `fixed` with it: its prefills, the
    engine's handling of its requests and, with the draft, the draft's first round over the prompts), then its
    decode steps (per group): one target step each without the draft, one cycle each with it. At one request a
    group with acceptance length AL, a request of n tokens decodes in n - 1 steps without the draft and
    (n - 1) / AL with it."""
    without = sum(plain_fixed + steps * target_step for steps in plain_decode_steps)
    with_draft = sum(fixed + steps * costs.cycle(k) for steps in decode_steps)
    return without / with_draft


def speed_report(run, plain) -> dict:
    """Tokens/s, latency, step costs and the predicted against the measured speed-up of one engine run with the
    draft (`acceptance.EngineRun`) against the one without it (None when 06 ran none): at the eval batch, and at
    each concurrency of `validate.latency_concurrency` (by its value, as a string key)."""
    k = run.num_speculative_tokens
    return {
        "eval_batch": phase_speed(run.batch_phase, plain.batch_phase if plain else None, k),
        "by_concurrency": {str(concurrency): phase_speed(group, plain.grouped.get(concurrency) if plain else None, k)
                           for concurrency, group in run.grouped.items()},
    }


def mean_or_none(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def worker_means_ms(group) -> dict[str, float]:
    """Each timed worker call's mean in ms, by name (`execute_model`, `propose@host`, ...)."""
    return {name: statistics.fmean(seconds) * 1e3 for name, seconds in sorted(group.worker_s.items()) if seconds}


def decode_step(group) -> float | None:
    """A phase's measured wall time per decode step (`acceptance.GroupedRequests`): its groups' decode spans over
    their decode steps. Without a draft this is the target step T; with it, the cycle."""
    steps = sum(group.decode_steps)
    return sum(group.timing.decode_spans_s) / steps if steps else None


def fixed_time(group) -> float:
    """A phase's wall time outside its groups' decode spans, per group: prefills, request handling."""
    return (group.timing.seconds - sum(group.timing.decode_spans_s)) / max(len(group.timing.decode_spans_s), 1)


def step_costs(group, plain_group, k: int, target_step: float | None) -> StepCosts | None:
    """The model's parts for one phase: the worker's means over the decode steps with the draft, and the time
    outside the worker's step from the engine without it (`target_step` less its worker step on the host's clock,
    the only clock on CPU); None where a part is missing."""
    rounds, forwards, sample_and_draft = (group.worker_s.get(name, [])
                                          for name in (PROPOSE, VERIFY_FORWARD, SAMPLE_AND_DRAFT))
    if not (target_step and plain_group.engine_steps_s and rounds and forwards and sample_and_draft):
        return None
    return StepCosts(verify_forward=statistics.fmean(forwards), draft_step=statistics.fmean(rounds) / k,
                     sample=statistics.fmean(sample_and_draft) - statistics.fmean(rounds),
                     outside=target_step - statistics.fmean(plain_group.host_engine_steps_s
                                                             or plain_group.engine_steps_s))


def phase_speed(group, plain_group, k: int) -> dict:
    """One phase's figures (`acceptance.GroupedRequests` with the draft and without it): the step costs, each from
    its own clock, the cycle they add up to against the measured one, the predicted and the measured speed-up."""
    target_step, cycle = decode_step(plain_group) if plain_group else None, decode_step(group)
    fixed, plain_fixed = fixed_time(group), fixed_time(plain_group) if plain_group else None
    costs = step_costs(group, plain_group, k, target_step)
    engine_step = mean_or_none(group.engine_steps_s)
    predicted = None
    if costs:
        time_ratio = predicted_speedup(costs, k, target_step, fixed, plain_fixed, plain_group.decode_steps,
                                       group.decode_steps)
        # in tokens/s, as measured: the two engines' outputs differ where a bf16 near-tie flipped a token
        predicted = time_ratio * group.timing.generated_tokens / plain_group.timing.generated_tokens

    def ms(seconds: float | None) -> float | None:
        return seconds * 1e3 if seconds is not None else None

    return {
        "with_draft": group.timing.to_json(),
        "without_draft": plain_group.timing.to_json() if plain_group else None,
        "mean_acceptance_length": group.mean_acceptance_length,
        "num_drafts": group.counts.drafts,  # vLLM's counter over this phase
        "groups": len(group.timing.decode_spans_s),  # `llm.generate` calls: requests submitted at once
        "decode_steps": sum(group.decode_steps),  # each group's, after its prefills (its slowest request's)
        "draft_rounds_timed": len(group.worker_s.get(PROPOSE, [])),
        "engine_steps_timed": len(group.engine_steps_s),
        # per group, before its decode span (prefills, request handling and, with the draft, its first round)
        "fixed_ms": ms(fixed),
        "first_draft_round_ms": ms(mean_or_none(group.worker_s.get(PROPOSE + IN_PREFILL, []))),  # in a prefill step
        "plain_fixed_ms": ms(plain_fixed),
        # without the draft: the decode step (wall time) and the worker's step in it
        "target_step_ms": ms(target_step),
        "plain_engine_step_ms": ms(mean_or_none(plain_group.engine_steps_s)) if plain_group else None,
        # the model's parts (StepCosts): with the draft, each timed on its own; outside from the engine without it,
        # on the host's clock
        "verify_forward_ms": ms(costs.verify_forward) if costs else None,
        "draft_step_ms": ms(costs.draft_step) if costs else None,
        "sample_ms": ms(costs.sample) if costs else None,
        "outside_step_ms": ms(costs.outside) if costs else None,
        "model_cycle_ms": ms(costs.cycle(k)) if costs else None,
        # measured with the draft: the cycle (wall time), the worker's engine step in it and the rest
        "cycle_ms": ms(cycle),
        "engine_step_ms": ms(engine_step),
        # on a GPU, the engine steps on the host's clock, with the draft and without it (None on CPU)
        "host_engine_step_ms": ms(mean_or_none(group.host_engine_steps_s)),
        "plain_host_engine_step_ms": ms(mean_or_none(plain_group.host_engine_steps_s)) if plain_group else None,
        "measured_outside_step_ms": ms(cycle - engine_step) if cycle and engine_step else None,
        # every timed worker call's mean, by name and clock (decode and prefill steps), with the draft and without it
        "worker_mean_ms": worker_means_ms(group),
        "plain_worker_mean_ms": worker_means_ms(plain_group) if plain_group else None,
        "predicted_speedup": predicted,
        "measured_speedup": group.timing.tokens_per_s / plain_group.timing.tokens_per_s if plain_group else None,
    }


# --- in vLLM's worker processes ------------------------------------------------------------------------------
class StepTimer:
    """Mixed into vLLM's worker class (06's worker extension): times the model runner's decode steps and, in an
    engine with a draft, the drafter's `propose` calls in them, through `llm.collective_rpc(START_STEP_TIMING)` ...
    `llm.collective_rpc(STEP_TIMING)`. A step that prefills (a prompt or a chunk of one) is kept apart (names with
    IN_PREFILL): its time is in the group's fixed time, which the model takes as a whole."""

    def start_step_timing(self) -> None:
        runner = self.model_runner
        timed = [(runner, name) for name in ENGINE_STEP_CALLS if callable(getattr(runner, name, None))]
        if (proposer := drafter(runner)) is not None:
            timed.append((proposer, PROPOSE))
        for owner, name in timed:
            if not getattr(getattr(owner, name), "timed", False):
                setattr(owner, name, _timed(getattr(owner, name), name))
        _intervals.clear()
        _decode_step[0] = False  # until a step begins
        _host_too[0] = _on_device()
        _recording[0] = True

    def step_timing(self) -> dict[str, list[float]]:
        """Seconds of each timed call since `start_step_timing`, by name (`execute_model`, `sample_tokens`,
        `propose`; in a prefill step `execute_model@prefill` and so on; on a GPU the host's `execute_model@host` and
        so on too); stops recording."""
        import torch

        _recording[0] = False
        if _on_device():
            torch.cuda.synchronize()
        seconds = {name: [start.elapsed_time(end) / 1e3 if hasattr(start, "elapsed_time") else end - start
                          for start, end in marks] for name, marks in _intervals.items()}
        _intervals.clear()
        return seconds


def drafter(runner):
    """The object whose `propose` runs one drafting round: Model Runner V2's `speculator`, V1's `drafter`; None in
    an engine without speculation."""
    proposer = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
    return proposer if callable(getattr(proposer, "propose", None)) else None


def _on_device() -> bool:
    import torch

    return torch.cuda.is_available()


def _mark():
    """A point in time on the device's stream (a CUDA event), or the host clock where there is no GPU."""
    import torch

    if _on_device():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def is_decode_step(scheduler_output) -> bool:
    """Whether an engine step (vLLM's SchedulerOutput) only decodes: each request scheduled one token and the draft
    tokens it verifies. A prefill or a prefill chunk schedules more."""
    verified = scheduler_output.scheduled_spec_decode_tokens or {}
    scheduled = scheduler_output.num_scheduled_tokens
    return bool(scheduled) and all(tokens == 1 + len(verified.get(request, ()))
                                   for request, tokens in scheduled.items())


def _timed(call, name: str):
    @functools.wraps(call)
    def timed_call(*args, **kwargs):
        if name == VERIFY_FORWARD:  # the step begins: execute_model(scheduler_output, ...)
            _decode_step[0] = is_decode_step(kwargs.get("scheduler_output", args[0] if args else None))
        if not _recording[0]:
            return call(*args, **kwargs)
        host_start, start = time.perf_counter(), _mark()
        result = call(*args, **kwargs)
        key = name if _decode_step[0] else name + IN_PREFILL
        _intervals.setdefault(key, []).append((start, _mark()))
        if _host_too[0]:
            _intervals.setdefault(key + ON_HOST, []).append((host_start, time.perf_counter()))
        return result

    timed_call.timed = True
    return timed_call
