"""06's speed figures: the quantiles, a phase's timing from vLLM's request timestamps, the step timer in a worker,
and the speed-up model from the step costs measured on their own (the engine runs: test_vllm_validate.py)."""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np
import pytest

from eagle3_pipeline.acceptance import AcceptanceCounts
from eagle3_pipeline.validate.acceptance import EngineRun, GroupedRequests
from eagle3_pipeline.validate.request_steps import RequestSteps
from eagle3_pipeline.validate.speed import (STEP_TIMING, StepCosts, StepTimer, Timing, is_decode_step,
                                            predicted_speedup, quantile, speed_report)


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
    timing.add([result(11, 0.5, 100.0, 102.0), result(1, 0.25, 100.5, 100.5)], seconds=3.0)
    assert timing.generated_tokens == 12 and timing.tokens_per_s == 4.0
    assert timing.latencies_s == [2.5, 0.25] and timing.first_token_s == [0.5, 0.25]
    assert timing.decode_spans_s == [1.5]  # the call's last first token (every prefill done) to its last token


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

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        time.sleep(0.01)

    def sample_tokens(self):
        return getattr(self, self.attribute).propose()


def scheduled(tokens: dict[str, int], verified: dict[str, list[int]]):
    """vLLM's SchedulerOutput down to what the step timer reads."""
    return SimpleNamespace(num_scheduled_tokens=tokens, scheduled_spec_decode_tokens=verified)


DECODE = scheduled({"a": 4, "b": 1}, {"a": [5, 6, 7]})  # a verifies 3 draft tokens, b decodes one token
PREFILL = scheduled({"a": 4, "c": 90}, {"a": [5, 6, 7]})  # c's prompt joins the step


def test_a_step_that_schedules_more_than_each_requests_token_and_draft_tokens_is_no_decode_step():
    assert is_decode_step(DECODE) and not is_decode_step(PREFILL)
    assert not is_decode_step(scheduled({}, {}))  # an empty step
    assert is_decode_step(scheduled({"b": 1}, None))


@pytest.mark.parametrize("attribute", ["drafter", "speculator"])  # V1, Model Runner V2
def test_step_timer_times_each_propose_and_engine_step_while_recording(attribute):
    worker = SimpleNamespace(model_runner=Runner(attribute, 0.02))
    proposer = getattr(worker.model_runner, attribute)
    StepTimer.start_step_timing(worker)
    StepTimer.start_step_timing(worker)  # wraps once
    assert proposer.propose(1, 2) == (1, 2)
    worker.model_runner.execute_model(DECODE)
    worker.model_runner.sample_tokens()
    worker.model_runner.execute_model(scheduler_output=PREFILL)  # a prefill step: kept apart
    worker.model_runner.sample_tokens()
    assert proposer.calls == 3
    seconds = StepTimer.step_timing(worker)
    assert sorted(seconds) == ["execute_model", "execute_model@prefill", "propose", "propose@prefill",
                               "sample_tokens", "sample_tokens@prefill"]
    assert [len(seconds[name]) for name in ("execute_model", "sample_tokens", "propose")] == [1, 1, 1]
    assert len(seconds["propose@prefill"]) == 2  # the call before any step, and the prefill step's
    assert 0.015 < seconds["propose"][0] < 0.5
    assert 0.005 < seconds["execute_model"][0] < 0.5 and seconds["sample_tokens"][0] >= seconds["propose"][0]
    single = GroupedRequests(Timing(concurrency=1), AcceptanceCounts(3), seconds, [])
    assert single.engine_steps_s == [seconds["execute_model"][0] + seconds["sample_tokens"][0]]
    proposer.propose()  # not recording any more
    assert proposer.calls == 4
    StepTimer.start_step_timing(worker)
    assert StepTimer.step_timing(worker) == {}


def test_on_a_gpu_each_call_is_timed_on_the_host_clock_too(monkeypatch):
    from eagle3_pipeline.validate import speed

    worker = SimpleNamespace(model_runner=Runner("drafter", 0.005))
    monkeypatch.setattr(speed, "_on_device", lambda: True)
    monkeypatch.setattr(speed, "_mark", time.perf_counter)  # the device's clock, as this CPU can stand it in
    StepTimer.start_step_timing(worker)
    monkeypatch.setattr(speed, "_on_device", lambda: False)  # step_timing's synchronize needs no GPU here
    worker.model_runner.execute_model(DECODE)
    worker.model_runner.sample_tokens()
    seconds = StepTimer.step_timing(worker)
    assert sorted(seconds) == ["execute_model", "execute_model@host", "propose", "propose@host", "sample_tokens",
                               "sample_tokens@host"]
    phase = GroupedRequests(Timing(concurrency=1), AcceptanceCounts(3), seconds, [])
    assert phase.host_engine_steps_s == [seconds["execute_model@host"][0] + seconds["sample_tokens@host"][0]]
    assert phase.host_engine_steps_s[0] >= phase.engine_steps_s[0] > 0.01


def test_step_timer_times_the_engine_steps_of_an_engine_without_a_draft():
    class PlainRunner:
        drafter = None

        def execute_model(self, scheduler_output):
            time.sleep(0.01)

        def sample_tokens(self):
            pass

    worker = SimpleNamespace(model_runner=PlainRunner())
    StepTimer.start_step_timing(worker)
    worker.model_runner.execute_model(scheduled({"b": 1}, {}))
    worker.model_runner.sample_tokens()
    seconds = StepTimer.step_timing(worker)
    assert sorted(seconds) == ["execute_model", "sample_tokens"] and seconds["execute_model"][0] > 0.005


def test_the_model_adds_the_cycle_up_and_predicts_wall_time_group_by_group():
    costs = StepCosts(verify_forward=0.010, draft_step=0.002, sample=0.001, outside=0.003)
    assert costs.cycle(3) == pytest.approx(0.020)
    # two groups, longest outputs 11 and 21 tokens, slowest requests 5 and 12 verifying steps: without the draft
    # 0.1 s then 10 (20) steps of 10 ms; with it 0.12 s then 5 (12) cycles of 20 ms
    predicted = predicted_speedup(costs, 3, target_step=0.010, fixed=0.12, plain_fixed=0.1,
                                  plain_decode_steps=[10, 20], decode_steps=[5, 12])
    assert predicted == pytest.approx((0.1 + 0.1 + 0.1 + 0.2) / (0.12 + 0.1 + 0.12 + 0.24))
    # a cycle of one target step and one token a step: the fixed times decide
    same = StepCosts(verify_forward=0.010, draft_step=0.0, sample=0.0, outside=0.0)
    assert predicted_speedup(same, 3, 0.010, 0.1, 0.1, [10], [10]) == pytest.approx(1.0)


def test_a_groups_decode_steps_start_once_its_last_request_has_its_first_token():
    # a's prompt fits the first step, b's second chunk ends at step 2 (chunked prefill): decoding together from
    # step 3, a emits at steps 3 and 4, b at 3, 4 and 5
    a, b = RequestSteps([1, 1, 1, 1, 1], [0, 1, 2, 3, 4]), RequestSteps([1, 1, 1, 1], [2, 3, 4, 5])
    phase = GroupedRequests(Timing(concurrency=2), AcceptanceCounts(0), {}, [[a, b], [RequestSteps([1, 3], [0, 1])]])
    assert phase.decode_steps == [3, 1]


def engine_run(k: int, tokens_per_s: float, worker_s: dict, accepted: int, drafts: int, first_token_s: float,
               tokens_per_step: int = 1):
    """One request of `tokens_per_s` tokens over 1 s, its first after `first_token_s`, then `tokens_per_step` a
    step."""
    tokens = round(tokens_per_s)
    timing = Timing(concurrency=1, generated_tokens=tokens, seconds=1.0, latencies_s=[1.0],
                    first_token_s=[first_token_s], decode_spans_s=[1.0 - first_token_s])
    counts = AcceptanceCounts(k, drafts, k * drafts, accepted, [accepted] + [0] * (k - 1) if k else [])
    steps = [1] + [tokens_per_step] * ((tokens - 1) // tokens_per_step)
    steps += [tokens - sum(steps)] if tokens > sum(steps) else []
    single = GroupedRequests(timing, counts, worker_s, [[RequestSteps(steps, list(range(len(steps))))]])
    return EngineRun(k, [], Timing(concurrency=4, generated_tokens=100, seconds=2.0, latencies_s=[1.0]), {1: single})


PLAIN_WORKER = {"execute_model": [0.006, 0.007, 0.008], "sample_tokens": [0.001, 0.001, 0.001]}
DRAFTED_WORKER = {"execute_model": [0.009, 0.010, 0.011], "propose": [0.006, 0.003, 0.009],
                  "sample_tokens": [0.008, 0.005, 0.011]}


def test_speed_report_fills_the_model_from_each_engines_own_clocks():
    plain = engine_run(0, tokens_per_s=100, worker_s=PLAIN_WORKER, accepted=0, drafts=0, first_token_s=0.01)
    drafted = engine_run(3, tokens_per_s=150, worker_s=DRAFTED_WORKER, accepted=100, drafts=50, first_token_s=0.12,
                         tokens_per_step=3)
    speed = speed_report(drafted, plain)["by_concurrency"]["1"]
    assert speed["mean_acceptance_length"] == 3.0  # 1 + 100 / 50
    # without the draft: 0.99 s after the first token over 99 steps, T 10 ms, of which the worker's step (mean 8 ms)
    # leaves 2 ms outside it
    assert speed["target_step_ms"] == pytest.approx(10.0) and speed["plain_engine_step_ms"] == pytest.approx(8.0)
    assert speed["outside_step_ms"] == pytest.approx(2.0)
    # with it, the worker's means: the verifying forward 10 ms, D = 6 / 3 ms, sampling 8 - 6 ms; a cycle of
    # 10 + 6 + 2 + 2 ms
    assert speed["verify_forward_ms"] == pytest.approx(10.0) and speed["draft_step_ms"] == pytest.approx(2.0)
    assert speed["sample_ms"] == pytest.approx(2.0) and speed["model_cycle_ms"] == pytest.approx(20.0)
    # 150 tokens: the prefill's, then 49 verifying steps of 3 tokens and a last of 2
    assert speed["decode_steps"] == 50 and speed["groups"] == 1
    # in tokens/s: the time ratio times 150 / 100 tokens
    assert speed["predicted_speedup"] == pytest.approx((0.01 + 99 * 0.010) / (0.12 + 50 * 0.020) * 1.5)
    assert speed["measured_speedup"] == pytest.approx(1.5)
    # measured: the decode span (1 s less the first token) over 50 verifying steps; the engine step's mean of
    # 17, 15 and 22 ms
    assert speed["cycle_ms"] == pytest.approx((1.0 - 0.12) / 50 * 1e3)
    assert speed["engine_step_ms"] == pytest.approx(18.0)
    assert speed["measured_outside_step_ms"] == pytest.approx(speed["cycle_ms"] - 18.0)
    # each timed call's mean, by name, for both engines: the parts the model reads and the ones it does not
    assert speed["worker_mean_ms"]["propose"] == pytest.approx(6.0)
    assert speed["plain_worker_mean_ms"].keys() == PLAIN_WORKER.keys()
    # no prediction without a run without the draft, nor without its engine steps
    assert speed_report(drafted, None)["by_concurrency"]["1"]["predicted_speedup"] is None
    untimed = engine_run(0, tokens_per_s=100, worker_s={}, accepted=0, drafts=0, first_token_s=0.01)
    assert speed_report(drafted, untimed)["by_concurrency"]["1"]["predicted_speedup"] is None


def test_on_a_gpu_the_time_outside_the_step_is_t_less_the_plain_worker_step_on_the_hosts_clock():
    # the engine without the draft schedules ahead: its host is back after 5 ms of each 8 ms device step, and the
    # 10 ms decode step leaves 5 ms on the host outside the worker, not the device clock's 2
    on_host = {"execute_model@host": [0.004, 0.004, 0.004], "sample_tokens@host": [0.001, 0.001, 0.001]}
    plain = engine_run(0, tokens_per_s=100, worker_s=PLAIN_WORKER | on_host, accepted=0, drafts=0,
                       first_token_s=0.01)
    drafted = engine_run(3, tokens_per_s=150, worker_s=DRAFTED_WORKER, accepted=100, drafts=50, first_token_s=0.12,
                         tokens_per_step=3)
    speed = speed_report(drafted, plain)["by_concurrency"]["1"]
    assert speed["plain_engine_step_ms"] == pytest.approx(8.0) and speed["plain_host_engine_step_ms"] == \
        pytest.approx(5.0)
    assert speed["outside_step_ms"] == pytest.approx(5.0) and speed["model_cycle_ms"] == pytest.approx(23.0)
    assert speed["predicted_speedup"] == pytest.approx((0.01 + 99 * 0.010) / (0.12 + 50 * 0.023) * 1.5)


class OutputProcessor:
    """vLLM's output processor as `recorded_steps` wraps it."""

    def __init__(self):
        self.request_states = {}

    def process_outputs(self, engine_core_outputs):
        pass


class ScriptedEngine:
    """`llm` as in_groups uses it: each generate call answers every request with 11 tokens over 1 s of decode, the
    group's j-th request (from 0) in j + 1 verifying steps after its prefill's token, as vLLM's output processor
    sees them."""

    def __init__(self):
        self.groups = []
        self.llm_engine = SimpleNamespace(output_processor=OutputProcessor())

    def get_metrics(self):
        return []

    def collective_rpc(self, method):
        """The worker's timing of one generate call: two decode steps."""
        return [{"execute_model": [0.01, 0.02]} if method == STEP_TIMING else None]

    def generate(self, requests, params, use_tqdm=False):
        self.groups.append(len(requests))
        processor = self.llm_engine.output_processor
        ids = [f"{len(self.groups)}-{j}" for j in range(len(requests))]
        steps = [[1] + [10 // (j + 1)] * j + [10 - 10 // (j + 1) * j] for j in range(len(requests))]
        for request_id in ids:
            processor.request_states[request_id] = SimpleNamespace(external_req_id=request_id)
        for step in range(max(map(len, steps))):  # one engine step: every request still running emits
            processor.process_outputs([SimpleNamespace(request_id=request_id, new_token_ids=[7] * tokens[step])
                                       for request_id, tokens in zip(ids, steps) if step < len(tokens)])
        results = [result(11, 0.5, 100.0, 101.0) for _ in requests]
        for request_id, answer in zip(ids, results):
            answer.request_id = request_id
        return results


@pytest.mark.parametrize("concurrency, groups", [(1, [1] * 5), (2, [2, 2, 1]), (8, [5])])
def test_prompts_run_in_groups_of_the_concurrency_and_each_waits_for_its_slowest_request(concurrency, groups):
    from eagle3_pipeline.validate.acceptance import EvalPrompt, in_groups

    llm = ScriptedEngine()
    prompts = [EvalPrompt("gsm8k", [1, 2, 3]) for _ in range(5)]
    run = in_groups(llm, None, prompts, params=None, k=0, concurrency=concurrency)
    assert llm.groups == groups and run.timing.concurrency == concurrency
    assert run.timing.generated_tokens == 55 and run.decode_steps == groups  # the slowest: size verifying steps
    assert run.worker_s == {"execute_model": [0.01, 0.02] * len(groups)}  # each group's, one after the other


def test_the_speed_report_has_a_row_per_concurrency():
    plain = engine_run(0, tokens_per_s=100, worker_s=PLAIN_WORKER, accepted=0, drafts=0, first_token_s=0.01)
    drafted = engine_run(3, tokens_per_s=150, worker_s=DRAFTED_WORKER, accepted=100, drafts=50, first_token_s=0.12)
    plain.grouped[4], drafted.grouped[4] = plain.grouped[1], drafted.grouped[1]
    del drafted.grouped[1]
    speed = speed_report(drafted, plain)["by_concurrency"]
    assert list(speed) == ["4"] and speed["4"]["measured_speedup"] == pytest.approx(1.5)
