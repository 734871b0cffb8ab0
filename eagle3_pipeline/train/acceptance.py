"""Acceptance length without a serving engine: greedy chain drafting replayed on the target's own answers.

With greedy sampling, what vLLM accepts is fixed by two things: the target's greedy continuation of each eval
prompt, and the draft's chain on it. When the eval split's answers are the target's greedy ones (01 with
`data.regenerate` at temperature 0), the draft's TTT forward over a sample gives, at every row t, its
proposals for the next steps (step s reads the true token of step s-1, which equals its own proposal exactly
while the chain holds). So the serving loop can be replayed on the sample:

    prompt of P tokens; the prefill writes answer token a_0 = x[P]; g = 1 tokens generated
    while g < N (N = min(validate.max_tokens, answer length)):
        the draft proposes k tokens from row P - 2 + g (the row whose input is the last token written)
        n = how many of them, from the first, equal the answer's next tokens
        drafts += 1; accepted += n; position i accepted when n > i; g += n + 1 (the target's own token)

    mean acceptance length = 1 + accepted / drafts      (vLLM's: 1 + num_accepted_tokens / num_drafts)

one served turn per eval row (01 writes a row per turn; `prompt_ids` is its prompt). What this cannot see:
vLLM's bf16 arithmetic in the draft, and answers that the serving run writes differently from 01's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3_pipeline.acceptance import AcceptanceCounts
from eagle3_pipeline.pack_plan import training_rows


def leading_matches(proposals: torch.Tensor, input_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
    """[B, L]: at each row, how many of the chain's proposals, from the first, equal the sample's next tokens.

    proposals [B, S, L] target token ids (step s at row t proposes the token at row t+1+s's input; -1 where a
    step has no row); input_ids, document_ids [B, L] as data.py packs them."""
    steps, length = proposals.shape[1], proposals.shape[2]
    leading = torch.zeros(input_ids.shape, dtype=torch.long, device=proposals.device)
    holds = torch.ones(input_ids.shape, dtype=torch.bool, device=proposals.device)
    for step in range(steps):
        rows = length - 1 - step  # row t's step-`step` token is the input of row t + 1 + step
        match = torch.zeros_like(holds)
        match[:, :rows] = (proposals[:, step, :rows] == input_ids[:, step + 1:]) & \
            (document_ids[:, step + 1:] == document_ids[:, :rows])
        holds &= match
        leading += holds
    return leading


def replay(leading: list[int], first_row: int, answer_tokens: int, max_tokens: int, counts: AcceptanceCounts) -> None:
    """Greedy chain drafting at `counts.k` over one served turn whose first draft reads row `first_row`."""
    generated, row = 1, first_row
    while generated < min(max_tokens, answer_tokens):
        accepted = min(leading[row], counts.k)
        counts.drafts += 1
        counts.draft_tokens += counts.k
        counts.accepted += accepted
        for position in range(accepted):
            counts.accepted_per_position[position] += 1
        generated += accepted + 1
        row += accepted + 1


@dataclass(frozen=True)
class ServedTurn:
    """Where one eval row's served turn lies in its packed row."""

    source: str
    first_row: int  # the row whose input is the prefill's token a_0: offset + prompt length - 1
    answer_tokens: int  # tokens after the prompt


def is_served(sample: dict) -> bool:
    """An eval row with an answer to replay (a prompt alone has none)."""
    return sample["seq_len"] > sample["prompt_len"]


def served_turns(samples: list[dict]) -> list[ServedTurn]:
    """The served turns of one pack's samples (`source`, `seq_len`, `prompt_len`), in pack order; rows as
    data.py lays them out (each sample gives seq_len - 1 rows)."""
    turns, offset = [], 0
    for sample in samples:
        if is_served(sample):
            turns.append(ServedTurn(sample["source"], offset + sample["prompt_len"] - 1,
                                    sample["seq_len"] - sample["prompt_len"]))
        offset += training_rows(sample["seq_len"])
    return turns


def target_proposals(top1: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """The draft's top-1 per step and row (draft vocab ids, -1 where a step has no row) as target token ids (a
    draft over the target's whole vocabulary has no d2t: its ids are the target's)."""
    if d2t is None:
        return top1
    return torch.where(top1 >= 0, top1 + d2t[top1.clamp(min=0)], -1)


def replay_batch(proposals: torch.Tensor, batch: dict, packs: list[tuple[int, ...]], samples: list[dict],
                 max_tokens: int, chains: dict[tuple[str, int], AcceptanceCounts]) -> None:
    """Replay every served turn of one batch of packed rows into `chains` (keyed by (source, k)).

    proposals [B, S, L] target ids; batch: the packed rows' input_ids and document_ids; packs: each row's
    sample indices into `samples` (`source`, `seq_len`, `prompt_len` per eval row)."""
    leading = leading_matches(proposals, batch["input_ids"], batch["document_ids"]).tolist()
    for row_leading, pack in zip(leading, packs):
        for turn in served_turns([samples[i] for i in pack]):
            for (source, k), counts in chains.items():
                if source == turn.source:
                    replay(row_leading, turn.first_row, turn.answer_tokens, max_tokens, counts)


def chain_metrics(chains: dict[tuple[str, int], AcceptanceCounts]) -> dict[str, float]:
    """The metric keys over all sources and per source, from counts keyed by (source, k)."""
    values, overall = {}, {}
    for (source, k), counts in chains.items():
        values |= counts.metrics(source)
        overall[k] = overall.get(k, AcceptanceCounts(k)) + counts
    for counts in overall.values():
        values |= counts.metrics()
    return values
