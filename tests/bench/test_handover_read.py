"""bench/handover_read.py: the engine's steps it records, and a small run of the read it times."""

from __future__ import annotations

import argparse

from bench.handover_read import measured, steps_of


def test_a_request_that_does_not_fit_a_step_is_chunked_into_the_next():
    assert steps_of(3, 5, 4) == [[(0, 0, 4)], [(0, 4, 5), (1, 0, 3)], [(1, 3, 5), (2, 0, 2)], [(2, 2, 5)]]
    assert steps_of(2, 3, 16) == [[(0, 0, 3), (1, 0, 3)]]


def test_every_round_is_read_and_timed():
    args = argparse.Namespace(hidden=16, aux=3, requests=6, tokens=10, step_tokens=16, rounds=4, beside_python=True)
    result = measured(args)
    assert result["bytes_per_round"] == 6 * 10 * (4 * 16 * 2 + 16)
    assert len(result["rounds"]) == 4 and all(r["seconds"] > 0 and r["GB_per_s"] > 0 for r in result["rounds"])
    assert result["median_GB_per_s_after_three_rounds"] == result["rounds"][3]["GB_per_s"]
