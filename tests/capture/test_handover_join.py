"""How the capture worker joins one request's chunks (no engine needed)."""

from __future__ import annotations

import pytest
import torch

from eagle3_pipeline.capture.handover import _join


def chunk(start: int, tokens: list[int]):
    ids = torch.tensor(tokens)
    states = ids.float()[:, None, None].expand(-1, 2, 3)  # aux [n, 2, 3], marked with the token id
    return start, ids, states, states[:, 0]


def test_chunks_are_joined_in_order():
    joined = _join("r", [chunk(0, [5, 6, 7]), chunk(3, [8, 9])])
    assert joined["token_ids"].tolist() == [5, 6, 7, 8, 9]
    assert joined["aux_hidden_states"].shape == (5, 2, 3) and joined["final_hidden_state"].shape == (5, 3)
    assert joined["aux_hidden_states"][:, 1, 0].tolist() == [5, 6, 7, 8, 9]


def test_a_recomputed_request_replaces_what_followed():
    # vLLM preempted the request after 4 tokens and recomputed it from its start.
    joined = _join("r", [chunk(0, [5, 6]), chunk(2, [7, 8]), chunk(0, [5, 6, 7, 8, 9])])
    assert joined["token_ids"].tolist() == [5, 6, 7, 8, 9]


def test_tokens_never_computed_are_an_error():
    with pytest.raises(RuntimeError, match="never computed"):
        _join("r", [chunk(4, [9, 10])])
