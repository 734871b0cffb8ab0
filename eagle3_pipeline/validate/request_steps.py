"""Stage 06: each request's own acceptance length, from the tokens vLLM emits for it at each engine step.

vLLM's spec-decode counters pool over requests (1 + accepted / drafts: long answers weigh most). The mean over
requests of each request's own acceptance length weighs every request once. vLLM 0.26 has no per-request
spec-decode figures (0.32's `per_request_spec_decode_metrics` is not in 0.26), so 06 reads them off the engine
steps: while `llm.generate` runs, `recorded_steps` sees the outputs of every engine step as vLLM's output
processor receives them (one `EngineCoreOutput` per request and step, its `new_token_ids`), and notes how many
tokens each step emitted for each request. `llm.generate` itself, its outputs and its timing stay as they are.

A request's first emitting step is its prefill's (one token); every later step that emits tokens for it is one
verifying step: the target checked the k draft tokens and kept the accepted ones plus its own. Per request:

    acceptance length   tokens emitted by its verifying steps / its verifying steps   ((generated - 1) / steps)

and `mean_request_acceptance_length` is the mean of that over the requests with a verifying step (one that
stops at its first token has none and is left out). Steps emitting nothing for a request (a prefill chunk) do
not count. Against vLLM's counters over the same requests: the verifying steps are its drafts (a request
preempted and recomputed would add one step without drafts), and the tokens they emitted are drafts + accepted
less what a stop (EOS, a stop token, max_tokens) cut from a request's last verifying step, which vLLM counts
as accepted: at most k per request.

SpecForge's bench_eagle3 (SGLang) reports sum of completion tokens / sum of verifying steps (`spec_verify_ct`)
over all requests of a benchmark: a pooled figure like vLLM's, but with each request's prefill token in the
numerator and a stop's cut tokens left out (SGLang appends tokens up to the stop).
"""

from __future__ import annotations

import contextlib
import statistics
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class RequestSteps:
    """The tokens vLLM emitted for one request at each engine step that emitted any, the prefill's first, and those
    steps' indices among the engine steps of its `llm.generate` call."""

    tokens_per_step: list[int]
    step_indices: list[int] = ()

    @property
    def verify_steps(self) -> int:
        return max(len(self.tokens_per_step) - 1, 0)

    @property
    def verified_tokens(self) -> int:
        """Tokens the verifying steps emitted: all but the prefill's."""
        return sum(self.tokens_per_step[1:])

    @property
    def acceptance_length(self) -> float | None:
        """Tokens per verifying step; None for a request that had none."""
        return self.verified_tokens / self.verify_steps if self.verify_steps else None


def mean_request_acceptance_length(requests: list[RequestSteps]) -> float | None:
    """The mean of the requests' own acceptance lengths, over those with a verifying step (None if none has)."""
    lengths = [r.acceptance_length for r in requests if r.verify_steps]
    return statistics.fmean(lengths) if lengths else None


@contextlib.contextmanager
def recorded_steps(llm) -> Iterator[dict[str, list[tuple[int, int]]]]:
    """Within the block: {request id (`RequestOutput.request_id`): (engine step index, tokens emitted) per engine
    step that emitted any for it}, as vLLM's output processor receives each step's outputs (the same in vLLM 0.26
    and 0.32; one call per engine step, counted from 0)."""
    processor = llm.llm_engine.output_processor
    process_outputs = processor.process_outputs
    emitted: dict[str, list[tuple[int, int]]] = defaultdict(list)
    step = [0]

    def recording(engine_core_outputs, *args, **kwargs):
        for output in engine_core_outputs:
            state = processor.request_states.get(output.request_id)  # keyed by vLLM's internal request id
            if output.new_token_ids and state is not None:
                emitted[state.external_req_id].append((step[0], len(output.new_token_ids)))
        step[0] += 1
        return process_outputs(engine_core_outputs, *args, **kwargs)

    processor.process_outputs = recording
    try:
        yield emitted
    finally:
        del processor.process_outputs  # the class's method again


def request_steps(results: list, emitted: dict[str, list[tuple[int, int]]]) -> list[RequestSteps]:
    """Each finished request's steps, in the order of `results` (`llm.generate`'s RequestOutputs)."""
    steps = []
    for result in results:
        pairs = emitted.get(result.request_id, [])
        indices, tokens = [index for index, _ in pairs], [count for _, count in pairs]
        generated = len(result.outputs[0].token_ids)
        if sum(tokens) != generated:
            raise RuntimeError(f"request {result.request_id}: vLLM's step outputs held {sum(tokens)} tokens, its "
                               f"output {generated}: this vLLM hands the output processor its steps otherwise")
        steps.append(RequestSteps(tokens, indices))
    return steps
