"""Stages 01, 04 and 06 (and the benches): one acceptance type, and the one place its metric keys are made.

`AcceptanceCounts` holds vLLM's spec-decode counters for one k: drafts (verifying steps, one per sequence),
draft tokens proposed, draft tokens accepted, and accepted per draft position. 04's eval produces them by
replaying greedy chain drafting (train/acceptance.py), 06 (and 01, regenerating with a draft) read
them from vLLM's own counters (`read_counters`), and all derive the same figures from them:

    mean acceptance length   1 + accepted / drafts          (tokens per target forward pass)
    acceptance at position i accepted_per_position[i] / drafts

Metric keys: `al_k<k>` (mean acceptance length), `al_k<k>_pos<i>` (acceptance at position i, from 1), each with
`/<eval source>` appended for one source's turns; `metric_key` makes them and `parse_metric_key` reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

METRIC_KEY = re.compile(r"al_k(\d+)(?:_pos(\d+))?(?:/(.+))?")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class AcceptanceCounts:
    k: int
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.accepted_per_position = self.accepted_per_position or [0] * self.k

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.accepted / max(self.drafts, 1)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [accepted / max(self.drafts, 1) for accepted in self.accepted_per_position]

    def __add__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        return AcceptanceCounts(self.k, self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                                self.accepted + other.accepted,
                                [a + b for a, b in zip(self.accepted_per_position, other.accepted_per_position)])

    def __sub__(self, earlier: AcceptanceCounts) -> AcceptanceCounts:
        """What was counted since `earlier` (two readings of the same counters)."""
        return AcceptanceCounts(self.k, self.drafts - earlier.drafts, self.draft_tokens - earlier.draft_tokens,
                                self.accepted - earlier.accepted,
                                [a - b for a, b in zip(self.accepted_per_position, earlier.accepted_per_position)])

    def as_list(self) -> list[int]:
        """The counts as one flat list (summed across processes as a tensor); `from_list` reads it back."""
        return [self.drafts, self.draft_tokens, self.accepted, *self.accepted_per_position]

    @classmethod
    def from_list(cls, k: int, values: list) -> AcceptanceCounts:
        drafts, draft_tokens, accepted, *per_position = (int(v) for v in values)
        return cls(k, drafts, draft_tokens, accepted, per_position)

    def metrics(self, source: str | None = None) -> dict[str, float]:
        """Mean acceptance length and acceptance per position under their metric keys."""
        values = {metric_key(self.k, source=source): self.mean_acceptance_length}
        values |= {metric_key(self.k, i + 1, source): rate for i, rate in enumerate(self.acceptance_per_position)}
        return values

    def vllm_counters(self) -> dict[str, int]:
        """The counts under the names of vLLM's `vllm:spec_decode_*` counters."""
        return {"num_drafts": self.drafts, "num_draft_tokens": self.draft_tokens, "num_accepted_tokens": self.accepted}


def metric_key(k: int, position: int | None = None, source: str | None = None) -> str:
    """`al_k<k>`, `al_k<k>_pos<position>`, either with `/<source>`."""
    return f"al_k{k}" + (f"_pos{position}" if position else "") + (f"/{source}" if source else "")


def parse_metric_key(key: str) -> tuple[int, int | None, str | None] | None:
    """(k, position or None, source or None) of a metric key; None for any other key."""
    match = METRIC_KEY.fullmatch(key)
    if match is None:
        return None
    return int(match[1]), int(match[2]) if match[2] else None, match[3]


def is_metric_key(key: str) -> bool:
    return METRIC_KEY.fullmatch(key) is not None


def overall_ks(keys) -> list[int]:
    """The k of each mean-acceptance-length key over all sources (`al_k<k>`) among `keys`."""
    return sorted({parsed[0] for parsed in map(parse_metric_key, keys) if parsed and parsed[1:] == (None, None)})


def read_counters(metrics: list, k: int) -> AcceptanceCounts:
    """The spec-decode counters of an engine so far (summed over label sets, e.g. engines)."""
    counters = dict.fromkeys(AcceptanceCounts(k).vllm_counters(), 0)
    per_position = [0] * k
    for metric in metrics:
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in counters:
            counters[name] += int(metric.value)
        elif metric.name == PER_POSITION:
            per_position = [a + int(b) for a, b in zip(per_position, metric.values)]
    return AcceptanceCounts(k, counters["num_drafts"], counters["num_draft_tokens"], counters["num_accepted_tokens"],
                            per_position)
