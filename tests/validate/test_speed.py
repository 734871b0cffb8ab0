"""06's speed figures: the quantiles, a phase's timing from vLLM's request timestamps, the draft step timer in a
worker, and the speed-up AL·T / (T + k·D) from measured step times (the engine runs: test_vllm_validate.py)."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

from eagle3_pipeline.acceptance import AcceptanceCounts
from eagle3_pipeline.validate.acceptance import EngineRun, GroupedRequests
from eagle3_pipeline.validate.speed import DraftStepTimer, Timing, quantile, speed_report


def test_quantile_matches_numpys_linear_interpolation():
    rng = random.Random(0)
    for size in (1, 2, 7, 30):
        values = [rng.uniform(0, 5) for _ in range(size)]
        for q in (0.0, 0.5, 0.9, 1.0):
            assert quantile(values, q) == pytest.approx(float(np.quantile(values, q)))
    assert quantile([], 0.5) is None


def result(tokens: int, first_token_latency: float, first_ts: float, last_ts: float):
    """What `llm.generate` returns per request, down to the fields Timing reads."""
    stats = SimpleNamespace(first_token_latency=first_token_latency, first_token_ts=first_ts, last_token_ts=last_ts)
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(tokens)))], metrics=stats)


def test_timing_reads_latency_and_decode_step_from_request_timestamps():
    timing = Timing(concurrency=2)
    timing.add([result(11, 0.5, 100.0, 102.0), result(1, 0.25, 200.0, 200.0)], seconds=3.0)
    assert timing.generated_tokens == 12 and timing.tokens_per_s == 4.0
    assert timing.latencies_s == [2.5, 0.25]
    assert timing.step_s == [0.2]  # 2 s over 10 decoded tokens; a one-token answer has no decode step
    assert timing.decode_s == 2.0


class Runner:
    """A model runner whose engine step (`execute_model`, then `sample_tokens`) runs one drafting round."""

    def __init__(self, attribute: str, seconds: float):
        proposer = SimpleNamespace(calls=0)

        def propose(*args):
            proposer.calls += 1
            time.sleep(seconds)
            return args

        proposer.propose = propose
        setattr(self, attribute, proposer)
        self.attribute = attribute

    def execute_model(self):
        time.sleep(0.01)

    def sample_tokens(self):
        return getattr(self, self.attribute).propose()


@pytest.mark.parametrize("attribute", ["drafter", "speculator"])  # V1, Model Runner V2
def test_draft_step_timer_times_each_propose_and_engine_step_while_recording(attribute):
    worker = SimpleNamespace(model_runner=Runner(attribute, 0.02))
    proposer = getattr(worker.model_runner, attribute)
    DraftStepTimer.start_draft_timing(worker)
    DraftStepTimer.start_draft_timing(worker)  # wraps once
    assert proposer.propose(1, 2) == (1, 2)
    worker.model_runner.execute_model()
    worker.model_runner.sample_tokens()
    seconds = DraftStepTimer.draft_timing(worker)
    assert sorted(seconds) == ["execute_model", "propose", "sample_tokens"]
    assert len(seconds["propose"]) == 2 and all(0.015 < s < 0.5 for s in seconds["propose"])
    assert 0.005 < seconds["execute_model"][0] < 0.5 and seconds["sample_tokens"][0] >= seconds["propose"][1]
    single = GroupedRequests(Timing(concurrency=1), AcceptanceCounts(3), seconds)
    assert single.draft_rounds_s == seconds["propose"]
    assert single.engine_steps_s == [seconds["execute_model"][0] + seconds["sample_tokens"][0]]
    proposer.propose()  # not recording any more
    assert proposer.calls == 3
    DraftStepTimer.start_draft_timing(worker)
    assert DraftStepTimer.draft_timing(worker) == {}


def test_draft_step_timer_needs_a_drafter():
    with pytest.raises(RuntimeError, match="no speculator or drafter"):
        DraftStepTimer.start_draft_timing(SimpleNamespace(model_runner=SimpleNamespace(drafter=None)))


def engine_run(k: int, step_s: float, tokens_per_s: float, rounds_s: list[float], accepted: int, drafts: int,
               engine_steps_s: list[float] = ()):
    timing = Timing(concurrency=1, generated_tokens=round(tokens_per_s), seconds=1.0, latencies_s=[1.0],
                    step_s=[step_s], decode_s=step_s * (round(tokens_per_s) - 1))
    counts = AcceptanceCounts(k, drafts, k * drafts, accepted, [accepted] + [0] * (k - 1) if k else [])
    worker_s = {"propose": rounds_s, "execute_model": [s / 2 for s in engine_steps_s],
                "sample_tokens": [s / 2 for s in engine_steps_s]} if k else {}
    single = GroupedRequests(timing, counts, worker_s)
    return EngineRun(k, [], Timing(concurrency=4, generated_tokens=100, seconds=2.0, latencies_s=[1.0]), {1: single})


def test_speed_report_predicts_al_t_over_t_plus_k_d():
    plain = engine_run(0, step_s=0.010, tokens_per_s=100, rounds_s=[], accepted=0, drafts=0)
    drafted = engine_run(3, step_s=0.020, tokens_per_s=150, rounds_s=[0.006, 0.003, 0.009], accepted=100, drafts=50,
                         engine_steps_s=[0.030, 0.020, 0.040])
    speed = speed_report(drafted, plain)["by_concurrency"]["1"]
    assert speed["mean_acceptance_length"] == 3.0  # 1 + 100 / 50
    assert speed["target_step_ms"] == pytest.approx(10.0) and speed["draft_step_ms"] == pytest.approx(2.0)
    assert speed["predicted_speedup"] == pytest.approx(3.0 * 10 / (10 + 3 * 2))
    assert speed["measured_speedup"] == pytest.approx(1.5)
    # 149 decoded tokens at 20 ms over 50 verifying steps: 59.6 ms a cycle, 43.6 more than T + k·D
    assert speed["cycle_ms"] == pytest.approx(0.020 * 149 / 50 * 1e3)
    assert speed["unexplained_ms"] == pytest.approx(speed["cycle_ms"] - 10 - 3 * 2)
    # the median engine step (30 ms) splits the cycle: 24 ms verifying beside k·D, the rest outside the worker
    assert speed["engine_step_ms"] == pytest.approx(30.0) and speed["verify_ms"] == pytest.approx(24.0)
    assert speed["outside_step_ms"] == pytest.approx(speed["cycle_ms"] - 30.0)
    # no target step without a run without the draft
    assert speed_report(drafted, None)["by_concurrency"]["1"]["predicted_speedup"] is None


class ScriptedEngine:
    """`llm` as in_groups uses it: each generate call answers every request with 11 tokens over 1 s of decode."""

    def __init__(self):
        self.groups = []

    def get_metrics(self):
        return []

    def generate(self, requests, params, use_tqdm=False):
        self.groups.append(len(requests))
        return [result(11, 0.5, 100.0, 101.0) for _ in requests]


@pytest.mark.parametrize("concurrency, groups", [(1, [1] * 5), (2, [2, 2, 1]), (8, [5])])
def test_prompts_run_in_groups_of_the_concurrency(concurrency, groups):
    from eagle3_pipeline.validate.acceptance import EvalPrompt, in_groups

    llm = ScriptedEngine()
    prompts = [EvalPrompt("gsm8k", [1, 2, 3]) for _ in range(5)]
    run = in_groups(llm, None, prompts, params=None, k=0, concurrency=concurrency)
    assert llm.groups == groups and run.timing.concurrency == concurrency
    assert run.timing.generated_tokens == 55 and run.timing.decode_s == pytest.approx(5.0)


def test_the_speed_report_has_a_row_per_concurrency():
    plain = engine_run(0, step_s=0.010, tokens_per_s=100, rounds_s=[], accepted=0, drafts=0)
    drafted = engine_run(3, step_s=0.020, tokens_per_s=150, rounds_s=[0.006], accepted=100, drafts=50)
    plain.grouped[4], drafted.grouped[4] = plain.grouped[1], drafted.grouped[1]
    del drafted.grouped[1]
    speed = speed_report(drafted, plain)["by_concurrency"]
    assert list(speed) == ["4"] and speed["4"]["measured_speedup"] == pytest.approx(1.5)
