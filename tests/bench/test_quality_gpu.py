"""bench/quality_gpu.py's planning and report (no GPU, no training): which drafts a run trains, and the targets
its report checks, against figures computed here by hand."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.quality_gpu import CONFIG, LEVERS, THEIR_LEVERS, draft_jobs
from bench.report import quality_gpu_markdown as markdown
from eagle3_pipeline.acceptance import metric_key

BENCH_CONFIG = Path(__file__).resolve().parents[2] / CONFIG


def test_draft_jobs_cover_curve_seeds_and_levers():
    args = argparse.Namespace(config=BENCH_CONFIG, curve_steps=[40, 160, 320, 640], levers=None, lever_seeds=[0, 1],
                              jobs=["curve", "seeds", "levers"])
    jobs = {name: (trainer, steps, seed, extra) for name, trainer, steps, seed, extra in draft_jobs(args)}
    for trainer in ("ours", "speculators"):
        assert [jobs[f"{trainer}-{s}-s0"][1] for s in (40, 160, 320, 640)] == [40, 160, 320, 640]
        assert {jobs[f"{trainer}-640-s{seed}"][2] for seed in (0, 1, 2)} == {0, 1, 2}
    levers = {name.removesuffix("-640-s0") for name, (_, steps, seed, extra) in jobs.items() if extra and seed == 0}
    assert levers == set(LEVERS) | set(THEIR_LEVERS)  # every lever of ours is a setting this checkout's schema has
    assert {jobs[f"{lever}-640-s0"][0] for lever in LEVERS} == {"ours"}
    assert jobs["speculators.eagle3.1-640-s0"][0] == "speculators"
    assert all(f"{lever}-640-s1" in jobs for lever in [*LEVERS, *THEIR_LEVERS])
    assert jobs["lr-warmup5pc-cosine-to-0-640-s0"][3][0] == "train.warmup_steps=32"  # 5% of the largest budget
    assert jobs["full-vocab-640-s0"][3] == ["draft.draft_vocab_size=49152",  # SmolLM2's whole vocabulary
                                            "train.loss_chunk_rows=1024"]


def test_seeds_and_levers_without_the_curve():
    args = argparse.Namespace(config=BENCH_CONFIG, curve_steps=[40, 640], levers=["fp8"], lever_seeds=[0, 1, 2],
                              jobs=["seeds", "levers"])
    names = [name for name, *_ in draft_jobs(args)]
    assert names == [f"{t}-640-s{s}" for s in (0, 1, 2) for t in ("ours", "speculators")] + [
        f"fp8-640-s{s}" for s in (0, 1, 2)]


def test_a_lever_can_name_its_own_seeds():
    args = argparse.Namespace(config=BENCH_CONFIG, curve_steps=[640], levers=["eagle3.1@0,1,2", "fp8"], lever_seeds=[0],
                              jobs=["levers"])
    assert [name for name, *_ in draft_jobs(args)] == ["eagle3.1-640-s0", "eagle3.1-640-s1", "eagle3.1-640-s2",
                                                       "fp8-640-s0"]


def test_speculators_own_eagle3_1_layout_is_what_its_cli_parses_as_eagle3_1():
    from speculators.train.config.schema import TrainConfig

    required = ["--verifier-name-or-path", "target", "--data-path", "data", "--save-path", "out"]
    defaults = TrainConfig.resolve(required).draft
    theirs = TrainConfig.resolve(required + THEIR_LEVERS["speculators.eagle3.1"]).draft
    # EAGLE 3.1: a norm per aux layer instead of one over their concatenation; the output norm as by default
    assert (defaults.fc_norm, defaults.norm_before_fc, defaults.norm_output) == (False, True, True)
    assert (theirs.fc_norm, theirs.norm_before_fc, theirs.norm_output) == (True, False, True)


def test_unknown_lever_setting_is_skipped(monkeypatch, capsys):
    monkeypatch.setitem(LEVERS, "no-such-knob", ["train.no_such_knob=1"])
    args = argparse.Namespace(config=BENCH_CONFIG, curve_steps=[40, 80], levers=["no-such-knob"], lever_seeds=[0],
                              jobs=["levers"])
    assert [name for name, *_ in draft_jobs(args) if "knob" in name] == []
    assert "lever no-such-knob skipped" in capsys.readouterr().out


def _draft(tokens: int, per_source: dict[str, float], overall: float, extra=(), seed: int = 0) -> dict:
    values = {metric_key(3): overall} | {metric_key(3, source=s): v for s, v in per_source.items()}
    return {"train_tokens": tokens, "train_wall_s": 10.0, "shared_eval": values, "extra": list(extra), "seed": seed}


def test_report_targets_against_hand_computation():
    sources = {"mtbench": 0, "humaneval.2": 0}
    ours = [_draft(640, {"mtbench": m, "humaneval.2": h}, 0, seed=i)
            for i, (m, h) in enumerate(((2.06, 3.0), (2.10, 3.1), (2.12, 3.2)))]
    theirs = [_draft(600, {"mtbench": m, "humaneval.2": h}, 0) for m, h in ((2.0, 3.0), (2.0, 2.9), (2.0, 3.1))]
    report = {"commands": ["c"], "curve_steps": [40, 640], "k": 3, "drafts": {
        **{f"ours-640-s{i}": d for i, d in enumerate(ours)},
        **{f"speculators-640-s{i}": d for i, d in enumerate(theirs)},
        "fp8-640-s0": _draft(640, dict.fromkeys(sources, 2.0), 0, ["train.fp8=true"]),
        "fp8-640-s1": _draft(640, dict.fromkeys(sources, 3.0), 0, ["train.fp8=true"], seed=1),
    }}
    text = markdown(report)
    # MT-Bench: ours' mean 2.0933 against their mean 2.0 is +4.7%; every seed above 2.0
    assert "- MT-Bench: ours 2.093 vs speculators 2.000 (+4.7%; target +3%: met; every seed above their mean: yes)" in text
    # mean of benchmarks: ours (2.53 + 2.60 + 2.66) / 3 = 2.5967 against theirs (2.5 + 2.45 + 2.55) / 3 = 2.5: +3.9%
    assert "- mean of benchmarks: ours 2.597 vs speculators 2.500 (+3.9%; target +3%: met" in text
    # the lever's seeds 0 and 1 (means of benchmarks 2.0, 3.0) against ours at seeds 0 and 1 (2.53, 2.60):
    # 2.5 / 2.565 - 1 = -2.5%; against speculators' mean 2.5: +0.0%, and seed 0 (2.0) is not above it
    assert ("| fp8 | 0,1 | `train.fp8=true` | 2.500 [2.000, 3.000] | 2.500 [2.000, 3.000] | 2.500 [2.000, 3.000] "
            "| -2.5% | +0.0% (no) |") in text
    assert "## Levers at 640 steps (ours; one setting" in text
    # speculators' trainer in its own EAGLE 3.1 layout is a lever too, named as such
    report["drafts"]["speculators.eagle3.1-640-s0"] = _draft(600, dict.fromkeys(sources, 2.6), 0,
                                                              THEIR_LEVERS["speculators.eagle3.1"])
    text = markdown(report)
    assert "(ours; `speculators.*`: speculators' trainer with those flags; one setting" in text
    assert ("| speculators.eagle3.1 | 0 | `--fc-norm --no-norm-before-fc` | 2.600 | 2.600 | 2.600 | +2.8% "
            "| +4.0% (yes) |") in text


def test_shipped_config_loads():
    from eagle3_pipeline.config import load_config

    config = load_config(BENCH_CONFIG, [])
    assert [s.kind for s in config.data.eval_sources] == ["mtbench", "humaneval", "gsm8k", "math500", "bfcl"]


def test_the_kimi_config_and_the_mla_levers():
    """bench/quality_gpu_kimi.yaml: the learned Kimi with BFCL among its eval sources; the MLA levers turn the draft's
    attention to MLA on both targets, with EAGLE 3.1's norms in the second."""
    from eagle3_pipeline.config import load_config

    kimi = BENCH_CONFIG.with_name("quality_gpu_kimi.yaml")
    config = load_config(kimi, [])
    assert (config.target.stand_in, config.target.weight_prefix) == ("tiny-kimi-k25-learned", "language_model.")
    assert [s.kind for s in config.data.eval_sources] == ["gsm8k", "humaneval", "mtbench", "bfcl"]
    for path in (BENCH_CONFIG, kimi):
        plain, mla = load_config(path, []).draft, load_config(path, LEVERS["mla"]).draft
        both = load_config(path, LEVERS["mla-eagle3.1"]).draft
        assert (plain.attention, mla.attention, both.attention) == ("llama", "mla", "mla")
        assert (mla.kv_lora_rank, mla.q_lora_rank, mla.fc_norm, both.fc_norm, both.norm_output) == (512, 64, False, True, True)
    args = argparse.Namespace(config=kimi, curve_steps=[640], levers=["mla@0,1,2"], lever_seeds=[0], jobs=["levers"])
    assert [(name, seed) for name, _, _, seed, _ in draft_jobs(args)] == [
        ("mla-640-s0", 0), ("mla-640-s1", 1), ("mla-640-s2", 2)]
    for path, hidden in ((BENCH_CONFIG, 576), (kimi, 256)):  # the query's rank: half the layer's 2 x hidden input
        args = argparse.Namespace(config=path, curve_steps=[640], levers=["mla-q_lora-half"], lever_seeds=[0],
                                  jobs=["levers"])
        [(name, _, _, _, overrides)] = draft_jobs(args)
        assert load_config(path, overrides).draft.q_lora_rank == hidden == load_config(path, []).draft.hidden_size


def test_the_serve_phase_serves_the_final_rows_and_the_best_lever_once():
    from bench.quality_gpu import drafts_to_serve

    drafts = {name: _draft(640, {}, al) for name, al in (("ours-640-s0", 2.0), ("speculators-640-s0", 2.1),
                                                          ("ours-40-s0", 1.2), ("ours-640-s1", 2.0),
                                                          ("fp8-640-s0", 2.05), ("eagle3.1-640-s0", 2.3),
                                                          ("eagle3.1-640-s1", 2.4))}
    drafts["speculators-640-s0"] = {"error": "failed"}
    assert drafts_to_serve(drafts, [40, 640], {}) == ["ours-640-s0", "ours-40-s0", "eagle3.1-640-s0"]
    assert drafts_to_serve(drafts, [40, 640], {"ours-640-s0": {}}) == ["ours-40-s0", "eagle3.1-640-s0"]
