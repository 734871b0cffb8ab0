"""The one acceptance type: its figures from counts, its keys made and read in one place."""

from __future__ import annotations

from eagle3_pipeline.acceptance import AcceptanceCounts, metric_key, overall_ks, parse_metric_key


def test_figures_follow_vllms_counter_definitions():
    counts = AcceptanceCounts(3, drafts=10, draft_tokens=30, accepted=12, accepted_per_position=[6, 4, 2])
    assert counts.mean_acceptance_length == 1 + 12 / 10
    assert counts.acceptance_per_position == [0.6, 0.4, 0.2]
    assert counts.vllm_counters() == {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12}
    assert AcceptanceCounts.from_list(3, counts.as_list()) == counts
    later = counts + AcceptanceCounts(3, 5, 15, 3, [2, 1, 0])
    assert later - counts == AcceptanceCounts(3, 5, 15, 3, [2, 1, 0])


def test_metric_keys_round_trip():
    for k, position, source in [(3, None, None), (3, 2, None), (5, None, "mtbench"), (1, 1, "humaneval.2")]:
        assert parse_metric_key(metric_key(k, position, source)) == (k, position, source)
    assert metric_key(3) == "al_k3" and metric_key(3, 1, "gsm8k") == "al_k3_pos1/gsm8k"
    assert parse_metric_key("acc_0") is None and parse_metric_key("al_kx") is None
    counts = AcceptanceCounts(4, 8, 32, 8, [4, 2, 1, 1])
    keys = counts.metrics() | counts.metrics("mtbench")
    assert overall_ks(keys) == [4] and keys[metric_key(4, 1, "mtbench")] == 0.5
