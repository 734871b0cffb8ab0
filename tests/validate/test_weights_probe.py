"""06's weights probe finds what the draft shares with the target by storage, on both of vLLM's model runners.

The runners are vLLM's own classes (V1 `GPUModelRunner`, whose drafter is `runner.drafter`, and Model Runner V2,
whose drafter is `runner.speculator`), built without an engine around a tiny target and draft, so the test reads
the draft the way the probe does in a worker: `runner.get_draft_model()`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from eagle3_pipeline.validate.weights_probe import (
    DraftWeightsProbe,
    loaded_parameters,
    shared_parameters,
    skipped_parameters,
)


class Body(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.fc = nn.Linear(8, 4, bias=False)


class CausalLM(nn.Module):
    def __init__(self, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        self.model = Body(embed_tokens)
        self.lm_head = lm_head


def target_and_draft(own_lm_head: bool) -> tuple[nn.Module, nn.Module]:
    """A tied target (lm_head is the embedding) and a draft that holds the target's embedding module, as vLLM's
    loader leaves a draft without embed_tokens; its lm_head its own (a smaller draft vocab) or the target's."""
    embed = nn.Embedding(16, 4)
    target_head = nn.Linear(4, 16, bias=False)
    target_head.weight = embed.weight
    target = CausalLM(embed, target_head)
    draft = CausalLM(embed, nn.Linear(4, 8, bias=False) if own_lm_head else target_head)
    draft.model.fc = nn.Linear(8, 4, bias=False)
    return target, draft


def v1_runner(target: nn.Module, draft: nn.Module | None):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runner = object.__new__(GPUModelRunner)
    runner.model = target
    runner.drafter = SimpleNamespace(model=draft) if draft is not None else None
    return runner


def v2_runner(target: nn.Module, draft: nn.Module | None):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.speculator import DraftModelSpeculator

    runner = object.__new__(GPUModelRunner)
    runner.model = target
    runner.speculator = None
    if draft is not None:
        # a subclass with the abstract methods stubbed: only its type matters to get_draft_model
        stubs = {name: None for name in DraftModelSpeculator.__abstractmethods__}
        runner.speculator = object.__new__(type("Speculator", (DraftModelSpeculator,), stubs))
        runner.speculator.model = draft
    return runner


RUNNERS = {"v1": v1_runner, "mrv2": v2_runner}


@pytest.mark.parametrize("runner_kind", RUNNERS)
@pytest.mark.parametrize("own_lm_head", [True, False])
def test_shared_weights_found_by_storage_on_both_runners(runner_kind, own_lm_head):
    target, draft = target_and_draft(own_lm_head)
    worker = SimpleNamespace(model_runner=RUNNERS[runner_kind](target, draft))
    report = DraftWeightsProbe.draft_weights_report(worker)
    expected = ["model.embed_tokens.weight"] if own_lm_head else ["lm_head.weight", "model.embed_tokens.weight"]
    assert report["shared"] == expected
    # a draft parameter that is a copy of the target's, not its storage, is not shared
    draft.model.embed_tokens = nn.Embedding(16, 4).requires_grad_(False)
    draft.model.embed_tokens.weight.data.copy_(target.model.embed_tokens.weight.data)
    assert "model.embed_tokens.weight" not in shared_parameters(draft, target)


def test_loaded_and_skipped_exclude_shared_and_name_the_rest():
    target, draft = target_and_draft(own_lm_head=True)
    names = sorted(name for name, _ in draft.named_parameters())
    report = {"loads": [{"received": ["fc.weight", "lm_head.weight", "t2d"], "loaded": ["lm_head.weight"],
                         "parameters": names}],
              "shared": shared_parameters(draft, target)}
    assert skipped_parameters(report) == (["model.fc.weight"], ["t2d"])
    assert loaded_parameters(report) == ["lm_head.weight"] and loaded_parameters({"loads": [], "shared": []}) == []


@pytest.mark.parametrize("runner_kind", RUNNERS)
def test_an_engine_without_a_draft_model_is_an_error(runner_kind):
    target, _ = target_and_draft(own_lm_head=True)
    worker = SimpleNamespace(model_runner=RUNNERS[runner_kind](target, None))
    with pytest.raises(RuntimeError, match="found no draft model"):
        DraftWeightsProbe.draft_weights_report(worker)
