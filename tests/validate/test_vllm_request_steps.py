"""Each request's engine steps as 06 records them (request_steps.py) against vLLM's own counts, in vLLM CPU on the
demo draft: a few held-out prompts, a few tokens, one engine start.

vLLM 0.32 can keep its own per-request record of each verifying step (`per_request_spec_decode_metrics`,
"detailed": the draft tokens accepted at each step): every step 06 counts is one of them, emitting accepted + 1
tokens, except that a stop may cut the last one short; and summed over the requests they are vLLM's counters.

    python -m pytest -m vllm tests/validate/test_vllm_request_steps.py -s    # -s prints the figures
"""

from __future__ import annotations

import pytest

from eagle3_pipeline.engine import speculative_config, start_engine
from eagle3_pipeline.target import target_path
from eagle3_pipeline.validate.acceptance import generate_counted
from eagle3_pipeline.validate.speed import Timing
from eagle3_pipeline.validate.stage import eval_prompts
from eagle3_pipeline.validate.worker import WORKER_EXTENSION
from tests.conftest import run_python
from tests.validate.runs import demo_run

PROMPTS, MAX_TOKENS, K = 4, 24, 3


@pytest.mark.vllm
def test_request_steps_are_vllms_verifying_steps_and_add_up_to_its_counters(tmp_path):
    from vllm import SamplingParams

    config, path = demo_run(tmp_path)
    export = run_python("05_export.py", "--config", str(path), timeout=600)
    assert export.returncode == 0, export.stdout[-3000:] + export.stderr[-3000:]
    prompts = eval_prompts(config)[:PROMPTS]
    llm = start_engine(config.target, target_path(config.target), disable_log_stats=False,
                       speculative_config=speculative_config(config.run_dir / "05_export" / "reference", K),
                       per_request_spec_decode_metrics="detailed", worker_extension_cls=WORKER_EXTENSION)
    try:
        results, counted = generate_counted(llm, [{"prompt_token_ids": p.token_ids} for p in prompts],
                                            SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), K,
                                            Timing(concurrency=PROMPTS), worker_s={})
    finally:
        llm.llm_engine.engine_core.shutdown()

    cut = 0  # tokens a stop cut from requests' last verifying steps, which vLLM counts as accepted
    for result, steps in zip(results, counted.requests):
        accepted = result.outputs[0].spec_decode_metrics.per_step_accepted  # vLLM's record of this request
        emitted = steps.tokens_per_step[1:]
        print(f"request {result.request_id}: emitted per verifying step {emitted}, vLLM's accepted {accepted}, "
              f"finished by {result.outputs[0].finish_reason}; acceptance length {steps.acceptance_length}")
        assert steps.tokens_per_step[0] == 1 and len(emitted) == len(accepted)
        assert emitted[:-1] == [a + 1 for a in accepted[:-1]] and 1 <= emitted[-1] <= accepted[-1] + 1
        cut += accepted[-1] + 1 - emitted[-1]
    counts = counted.counts
    verified = sum(steps.verified_tokens for steps in counted.requests)
    print(f"vLLM's counters: {counts}; per-request mean {counted.mean_request_acceptance_length:.3f}, pooled "
          f"{counted.mean_acceptance_length:.3f}, cut by stops {cut}")
    assert counts.drafts > 0 and counts.accepted > 0  # the draft ran and was accepted
    assert sum(steps.verify_steps for steps in counted.requests) == counts.drafts
    assert verified + cut == counts.drafts + counts.accepted
    # the pooled figure from the per-request counts: vLLM's own, once the cut tokens are counted back
    assert (verified + cut) / counts.drafts == pytest.approx(counted.mean_acceptance_length, rel=1e-12)
