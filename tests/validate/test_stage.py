"""06's dynamic verdict from vLLM's counters: a skipped draft parameter, no drafts, a train/serve mismatch, a greedy
output the draft changed."""

from __future__ import annotations

from eagle3_pipeline.acceptance import read_counters
from eagle3_pipeline.config_sections import ValidateConfig
from eagle3_pipeline.validate.acceptance import Divergence, EngineRun
from eagle3_pipeline.validate.speed import Timing
from eagle3_pipeline.validate.stage import dynamic_problems
from tests.conftest import EngineStarted, record_engine_starts

VALIDATE = ValidateConfig(min_acceptance_ratio=0.5, max_tie_margin=0.5)


class Metric:  # the fields of vllm.v1.metrics.reader's Counter / Vector that read_counters uses
    def __init__(self, name, value=None, values=None):
        self.name, self.value, self.values = name, value, values


def served(drafts: int, accepted_per_position: list[int], skipped: list[str] | None = None) -> EngineRun:
    counts = read_counters([
        Metric("vllm:spec_decode_num_drafts", drafts),
        Metric("vllm:spec_decode_num_draft_tokens", drafts * len(accepted_per_position)),
        Metric("vllm:spec_decode_num_accepted_tokens", sum(accepted_per_position)),
        Metric("vllm:spec_decode_num_accepted_tokens_per_pos", values=accepted_per_position),
        Metric("vllm:prompt_tokens", 999),  # other counters are ignored
    ], len(accepted_per_position))
    return EngineRun(len(accepted_per_position), [[1, 2, 3]], Timing(concurrency=1), counts=counts,
                     skipped_parameters=skipped or [])


def test_acceptance_figures_from_the_counters():
    run = served(drafts=100, accepted_per_position=[40, 20, 10])
    assert run.mean_acceptance_length == 1.7
    assert run.acceptance_per_position == [0.4, 0.2, 0.1]


def test_a_healthy_run_has_no_problems():
    assert dynamic_problems([served(100, [40, 20, 10])], step0=0.45, validate=VALIDATE) == []


def test_first_position_far_below_the_eval_accuracy_is_a_mismatch():
    problems = dynamic_problems([served(100, [10, 2, 0])], step0=0.45, validate=VALIDATE)
    assert len(problems) == 1
    assert problems[0].startswith("k=3: train/serve mismatch: position-1 acceptance 0.100 < 0.5 x eval step-0 "
                                  "accuracy 0.450")


def test_skipped_parameters_and_no_drafts_fail():
    problems = dynamic_problems([served(0, [0, 0, 0], skipped=["model.fc.weight"])], step0=None, validate=VALIDATE)
    assert problems == ["k=3: vLLM did not load these draft parameters from the export: ['model.fc.weight']",
                        "k=3: vLLM proposed no drafts: speculation did not run"]


def test_a_changed_greedy_output_fails_unless_the_target_was_near_a_tie():
    run = served(100, [40, 20, 10])
    run.divergences = [Divergence(3, "mtbench", 7, 11, 12, margin=0.25, margin_exact=True)]
    assert dynamic_problems([run], step0=0.45, validate=VALIDATE) == []  # a bf16 near-tie: reported, not failed
    run.divergences = [Divergence(3, "mtbench", 7, 11, 12, margin=1.5, margin_exact=True),
                       Divergence(4, "humaneval", 0, 11, 12, margin=0.1, margin_exact=False)]
    problems = dynamic_problems([run], step0=0.45, validate=VALIDATE)
    assert problems == [
        "k=3: the greedy output of eval prompt 3 (mtbench) differs from the one without the draft at token 7 (12 "
        "instead of 11) where the target's logit margin is 1.500 > validate.max_tie_margin 0.5 and > the target's "
        "own batch variance 0.000: the draft changed what the target writes",
        "k=3: the greedy output of eval prompt 4 (humaneval) differs from the one without the draft at token 0 (12 "
        "instead of 11) where the target's logit margin is at least 0.100 (a token outside its top 20): the draft "
        "changed what the target writes"]


def test_a_token_the_target_flips_alone_under_another_batch_shape_is_not_the_drafts():
    run = served(100, [40, 20, 10])
    departs_there = Divergence(3, "gsm8k", 7, 11, 12, margin=2.0, margin_exact=True, alone_departs_at=7)
    departs_earlier = Divergence(4, "gsm8k", 9, 11, 12, margin=2.0, margin_exact=True, alone_departs_at=5)
    run.divergences = [departs_there, departs_earlier]
    problems = dynamic_problems([run], step0=0.45, validate=VALIDATE)
    assert [p.split(" (")[0] for p in problems] == ["k=3: the greedy output of eval prompt 4"]


def test_the_target_alone_sets_how_far_its_batch_variance_reaches():
    # prompt 5: the target alone flips a token at margin 1.25 by itself; so a margin of 1.0 elsewhere is within
    # the target's own variance, 1.5 is not; a negative margin means a fresh prefill prefers the drafted token
    flips_alone = Divergence(5, "gsm8k", 30, 11, 12, margin=0.1, margin_exact=True, alone_departs_at=20,
                             alone_margin=-1.25)
    within = Divergence(6, "gsm8k", 9, 11, 12, margin=1.0, margin_exact=True)
    beyond = Divergence(7, "gsm8k", 9, 11, 12, margin=1.5, margin_exact=True)
    preferred = Divergence(8, "gsm8k", 9, 11, 12, margin=-3.0, margin_exact=True)
    first, second = served(100, [40, 20, 10]), served(100, [40, 20, 10])
    first.divergences, second.divergences = [flips_alone, within, preferred], [beyond]
    problems = dynamic_problems([first, second], step0=0.45, validate=VALIDATE)  # the bound holds across runs
    assert [p.split(" (")[0] for p in problems] == ["k=3: the greedy output of eval prompt 7"]
    assert "> the target's own batch variance 1.250" in problems[0]
    first.divergences = [within, preferred]  # without the flip, 1.0 is the draft's
    assert [p.split(" (")[0] for p in dynamic_problems([first], 0.45, VALIDATE)] == [
        "k=3: the greedy output of eval prompt 6"]


class ProbedEngine:
    """`llm.generate` as probe_divergences calls it: greedy runs of a prompt alone, and one-token probes that return
    the log-probabilities set for their prefix."""

    def __init__(self, alone: dict[tuple, list[int]], logprobs: dict[tuple, dict[int, float]]):
        self.alone, self.logprobs = alone, logprobs

    def generate(self, requests, params, use_tqdm=False):
        from types import SimpleNamespace as Record
        results = []
        for prompt in requests:
            ids = tuple(prompt["prompt_token_ids"])
            if params.logprobs:
                ranked = {token: Record(logprob=lp) for token, lp in self.logprobs[ids].items()}
                results.append(Record(outputs=[Record(token_ids=[], logprobs=[ranked])]))
            else:
                results.append(Record(outputs=[Record(token_ids=self.alone[ids], logprobs=None)]))
        return results


def test_probe_divergences_measures_the_margin_where_the_target_alone_departs():
    from vllm import SamplingParams

    from eagle3_pipeline.validate.acceptance import EvalPrompt, batch_variance_margin, probe_divergences
    prompts = [EvalPrompt("gsm8k", [1, 2]), EvalPrompt("gsm8k", [3]), EvalPrompt("gsm8k", [4])]
    plain = [[7, 8, 9], [5, 6], [5]]
    drafted = [[7, 8, 10], [5, 6], [6]]  # prompt 0 differs at token 2, prompt 2 at token 0
    engine = ProbedEngine(
        alone={(1, 2): [7, 4, 9], (4,): [5]},  # prompt 0 alone departs at token 1, prompt 2 not at all
        logprobs={(1, 2, 7, 8): {9: -0.5, 10: -2.5}, (1, 2, 7): {8: -1.0, 4: -1.75}, (4,): {5: -0.25}})
    first, second = probe_divergences(engine, None, prompts, plain, drafted, SamplingParams(temperature=0.0))
    assert (first.prompt, first.position, first.margin, first.margin_exact) == (0, 2, 2.0, True)
    assert (first.alone_departs_at, first.alone_margin) == (1, 0.75)
    assert (second.prompt, second.position, second.margin_exact, second.alone_departs_at) == (2, 0, False, None)
    assert second.margin == 0.0 and second.alone_margin is None  # token 6 outside the top ones counts at the floor
    assert batch_variance_margin([first, second]) == 0.75


def test_first_difference():
    from eagle3_pipeline.validate.acceptance import first_difference
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2


def test_the_divergence_table_gives_each_verdict():
    from dataclasses import asdict

    from eagle3_pipeline.validate.report import divergence_table
    divergences = [Divergence(1, "gsm8k", 4, 11, 12, margin=0.25, margin_exact=True),
                   Divergence(2, "gsm8k", 7, 11, 12, margin=2.0, margin_exact=True, alone_departs_at=7),
                   Divergence(3, "gsm8k", 9, 11, 12, margin=2.0, margin_exact=True, alone_departs_at=5)]
    rows = [asdict(d) | {"verdict": d.verdict(0.5)} for d in divergences]
    table = divergence_table({"max_tie_margin": 0.5, "runs": [{"num_speculative_tokens": 3, "divergences": rows}]})
    verdicts = [line.split(" | ")[-3:] for line in table.splitlines()[2:]]
    assert verdicts == [["-", "-", "bf16 near-tie |"], ["7", "-", "the target's own batch variance |"],
                        ["5", "-", "changed by the draft |"]]


def test_validate_engine_dtype_runs_both_engines_in_it_and_makes_only_06_stale(monkeypatch, tmp_path):
    """`validate.engine_dtype` reaches the engine with the draft and the one without (what the greedy check
    compares), and a change reruns 06 alone: 01's answers stay."""
    import pytest

    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.stage_io import stages_made_stale_by
    from eagle3_pipeline.validate import acceptance

    started = record_engine_starts(monkeypatch, acceptance)
    for dtype in ("float32", None):
        config = load_config("configs/demo.yaml", [f"validate.engine_dtype={dtype or 'null'}"])
        for k in (0, 3):
            with pytest.raises(EngineStarted):
                acceptance.serve(config, tmp_path, [], tmp_path / "export", k)
    assert [settings.get("dtype") for settings in started] == ["float32", "float32", None, None]
    assert "speculative_config" in started[1] and "speculative_config" not in started[0]
    assert stages_made_stale_by("validate.engine_dtype") == ["06_validate"]


def test_06_starts_the_target_text_only_unless_an_eval_prompt_has_images(monkeypatch, tmp_path):
    import pytest

    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.validate import acceptance

    started = record_engine_starts(monkeypatch, acceptance)
    config = load_config("configs/tiny_kimi.yaml", [])
    text, picture = acceptance.EvalPrompt("mtbench", [1, 2]), acceptance.EvalPrompt("pictures", [1, 2], [b"png"])
    for prompts in ([text], [text, picture]):
        with pytest.raises(EngineStarted):
            acceptance.serve(config, tmp_path, prompts, tmp_path / "export", 3)
    assert [settings["text_only"] for settings in started] == [True, False]


def test_06_says_when_its_engines_run_in_another_dtype_than_02_captured_in(tmp_path):
    """`validate.engine_dtype` other than the capture's dtype (target.engine.dtype, `auto` read from the
    checkpoint) gets a caveat line; the same dtype, or none set, gets none."""
    import json

    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.validate.stage import dtype_caveat

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))

    def caveat(*overrides: str) -> str | None:
        return dtype_caveat(load_config("configs/demo.yaml", list(overrides)), tmp_path)

    assert caveat() is None
    assert caveat("validate.engine_dtype=bfloat16") is None
    assert caveat("validate.engine_dtype=float16", "target.engine.dtype=float16") is None
    line = caveat("validate.engine_dtype=float16")
    assert line is not None and "engines in float16" in line
    assert "captured the draft's training states in bfloat16" in line
    assert "in float32" in caveat("validate.engine_dtype=bfloat16", "target.engine.dtype=float32")
