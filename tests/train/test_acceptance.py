"""Simulated acceptance (acceptance.py) against a literal greedy speculative-decoding loop on the same draft."""

from __future__ import annotations

import random
import zlib

import pytest
import torch

from eagle3_pipeline.acceptance import AcceptanceCounts
from eagle3_pipeline.train.acceptance import leading_matches, replay, served_turns


def draft_next(context: tuple[int, ...], truth: dict[tuple[int, ...], int]) -> int:
    """A deterministic draft: right where a hash of the context says so (about 60%), else a wrong token."""
    right = truth.get(context)
    if right is not None and zlib.crc32(repr(context).encode()) % 10 < 6:
        return right
    return 10_000 + len(context)  # never a sample token


def speculative_decoding(prompt: list[int], answer: list[int], k: int, max_tokens: int, truth) -> AcceptanceCounts:
    """What vLLM does with greedy sampling: the target writes `answer`; the draft chains k tokens on its own."""
    counts = AcceptanceCounts(k)
    sequence, n = list(prompt) + [answer[0]], min(max_tokens, len(answer))
    while len(sequence) - len(prompt) < n:
        proposed, context = [], tuple(sequence)
        for _ in range(k):
            proposed.append(draft_next(context, truth))
            context += (proposed[-1],)
        g = len(sequence) - len(prompt)
        accepted = 0
        while accepted < k and g + accepted < len(answer) and proposed[accepted] == answer[g + accepted]:
            accepted += 1
        counts.drafts += 1
        counts.draft_tokens += k  # vLLM counts every proposed token
        counts.accepted += accepted
        for i in range(accepted):
            counts.accepted_per_position[i] += 1
        sequence += answer[g: g + accepted + 1]
    return counts


def packed_proposals(samples: list[tuple[list[int], list[int]]], steps: int, length: int, truth):
    """The TTT forward's proposals on a packed row as data.py lays it out (row t: input x[t+1]): step s at
    row t reads the true tokens through x[t+1+s] and proposes x[t+2+s]."""
    input_ids = torch.zeros(1, length, dtype=torch.long)
    document_ids = torch.full((1, length), -1, dtype=torch.long)
    proposals = torch.full((1, steps, length), -1, dtype=torch.long)
    offset = 0
    for document, (prompt, answer) in enumerate(samples):
        x = prompt + answer
        for t in range(len(x) - 1):
            input_ids[0, offset + t], document_ids[0, offset + t] = x[t + 1], document
            for step in range(steps):
                proposals[0, step, offset + t] = draft_next(tuple(x[: t + 2 + step]), truth)
        offset += len(x) - 1
    return proposals, input_ids, document_ids


@pytest.mark.parametrize("k, max_tokens", [(1, 40), (3, 40), (3, 12), (5, 40)])
def test_replay_on_the_ttt_forward_counts_what_speculative_decoding_counts(k, max_tokens):
    rng = random.Random(k * 100 + max_tokens)
    samples = [([rng.randrange(50) for _ in range(rng.randint(3, 9))], [rng.randrange(50) for _ in range(n)])
               for n in (30, 1, 17, 45)]
    truth = {tuple(p + a[:i]): a[i] for p, a in samples for i in range(1, len(a))}  # the target's next token
    proposals, input_ids, document_ids = packed_proposals(samples, k, 256, truth)
    leading = leading_matches(proposals, input_ids, document_ids)[0].tolist()
    rows = [{"source": "s", "seq_len": len(p) + len(a), "prompt_len": len(p)} for p, a in samples]
    simulated, expected = AcceptanceCounts(k), AcceptanceCounts(k)
    for turn, (prompt, answer) in zip(served_turns(rows), samples):
        replay(leading, turn.first_row, turn.answer_tokens, max_tokens, simulated)
        expected = expected + speculative_decoding(prompt, answer, k, max_tokens, truth)
    assert expected.drafts > 10 and expected.accepted > 5
    assert simulated == expected
    assert simulated.metrics()[f"al_k{k}"] == 1 + expected.accepted / expected.drafts


def test_a_prompt_without_an_answer_is_not_replayed_and_offsets_follow_the_pack():
    rows = [{"source": "a", "seq_len": 5, "prompt_len": 5}, {"source": "b", "seq_len": 9, "prompt_len": 4}]
    (turn,) = served_turns(rows)
    assert (turn.source, turn.first_row, turn.answer_tokens) == ("b", 4 + 3, 5)
