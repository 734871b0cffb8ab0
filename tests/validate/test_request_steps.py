"""Each request's own acceptance length from the tokens each engine step emitted for it (request_steps.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eagle3_pipeline.acceptance import AcceptanceCounts
from eagle3_pipeline.validate.acceptance import EngineRun, SourceCounts
from eagle3_pipeline.validate.request_steps import (
    RequestSteps,
    mean_request_acceptance_length,
    recorded_steps,
    request_steps,
)
from eagle3_pipeline.validate.speed import Timing
from eagle3_pipeline.validate.stage import acceptance_lengths


def test_a_requests_acceptance_length_leaves_its_prefill_token_out():
    steps = RequestSteps([1, 4, 2, 1, 3])  # prefill, then 4 verifying steps of k=3: 10 tokens
    assert (steps.verify_steps, steps.verified_tokens, steps.acceptance_length) == (4, 10, 2.5)
    assert RequestSteps([1]).acceptance_length is None  # stopped at its first token: no verifying step
    assert RequestSteps([]).verify_steps == 0


def test_the_mean_weighs_each_request_once_where_the_pooled_figure_weighs_tokens():
    long, short, first_only = RequestSteps([1] + [4] * 9 + [1]), RequestSteps([1, 1, 1]), RequestSteps([1])
    # long: 37 tokens in 10 steps (3.7); short: 2 in 2 (1.0); first_only has no verifying step and is left out
    assert mean_request_acceptance_length([long, short, first_only]) == pytest.approx((3.7 + 1.0) / 2)
    assert mean_request_acceptance_length([first_only]) is None
    # the same requests as vLLM counts them at k=3 (no stop cut a last step): 12 drafts, 27 accepted
    pooled = AcceptanceCounts(3, drafts=12, draft_tokens=36, accepted=27).mean_acceptance_length
    assert pooled == pytest.approx((37 + 2) / (10 + 2)) == pytest.approx(3.25)


def test_the_report_gives_both_figures_and_what_they_are_taken_over():
    requests = [RequestSteps([1, 4, 4]), RequestSteps([1, 2]), RequestSteps([1])]
    run = EngineRun(3, [[0] * 9, [0] * 3, [0]], Timing(concurrency=3),
                    counts=AcceptanceCounts(3, drafts=3, draft_tokens=9, accepted=7),
                    by_source={"a": SourceCounts(AcceptanceCounts(3, 2, 6, 6), requests[:2]),
                               "b": SourceCounts(AcceptanceCounts(3, 1, 3, 1), requests[2:])})
    assert acceptance_lengths(run) == {"mean_acceptance_length": 1 + 7 / 3, "mean_request_acceptance_length": 3.0,
                                       "requests_verified": 2, "num_verify_steps": 3, "generated_tokens": 13}
    assert acceptance_lengths(run.by_source["b"])["mean_request_acceptance_length"] is None


class FakeProcessor:
    """vLLM's OutputProcessor as `recorded_steps` uses it: request states by internal id, `process_outputs`."""

    def __init__(self, ids: dict[str, str]):
        self.request_states = {internal: SimpleNamespace(external_req_id=external) for internal, external in ids.items()}
        self.processed = []

    def process_outputs(self, engine_core_outputs, engine_core_timestamp=None, iteration_stats=None):
        self.processed.append(len(engine_core_outputs))


def step(*outputs: tuple[str, int]) -> list:
    return [SimpleNamespace(request_id=request_id, new_token_ids=[7] * tokens) for request_id, tokens in outputs]


def test_recorded_steps_counts_each_steps_tokens_per_request_and_passes_the_outputs_on():
    processor = FakeProcessor({"0-ab12cd34": "0", "1-ef56ab78": "1"})
    llm = SimpleNamespace(llm_engine=SimpleNamespace(output_processor=processor))
    with recorded_steps(llm) as emitted:
        engine = llm.llm_engine.output_processor
        engine.process_outputs(step(("0-ab12cd34", 1)), engine_core_timestamp=1.0)  # 0's prefill; 1's first chunk
        engine.process_outputs(step(("0-ab12cd34", 3), ("1-ef56ab78", 1)))
        engine.process_outputs(step(("0-ab12cd34", 0), ("1-ef56ab78", 4)))  # nothing for 0 at this step
        engine.process_outputs(step(("gone-12345678", 2)))  # a request the processor no longer tracks
    assert emitted == {"0": [(0, 1), (1, 3)], "1": [(1, 1), (2, 4)]} and processor.processed == [1, 2, 2, 1]
    assert "process_outputs" not in vars(processor)  # the class's method again

    results = [SimpleNamespace(request_id=i, outputs=[SimpleNamespace(token_ids=[7] * n)]) for i, n in (("0", 4), ("1", 5))]
    assert request_steps(results, emitted) == [RequestSteps([1, 3], [0, 1]), RequestSteps([1, 4], [1, 2])]
    results[1].outputs[0].token_ids.append(7)
    with pytest.raises(RuntimeError, match="request 1: vLLM's step outputs held 5 tokens, its output 6"):
        request_steps(results, emitted)
