"""The losses of `train.loss` against independent formulas, and the fused, chunked head + loss against the
plain computation in value and gradients (CPU, float64)."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from eagle3_pipeline.config_sections import TrainConfig
from eagle3_pipeline.train.draft_model import VerifierTargets
from eagle3_pipeline.train.loss import LOSSES, Objective, acceptance, chunked_head_loss
from tests.train.test_draft_model import packed, step_logits, tiny_model

ETA = 2.5  # lk's eta in these tests: not the default, so a test catches a default used in its place


def reference_row_loss(name: str, log_p: torch.Tensor, log_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and KL per row, written from the definitions: TV as half the L1 distance (not through min), the
    acceptance rate as 1 - TV, LK^lambda with its blend weight held constant."""
    p, q = log_p.exp(), log_q.exp()
    kl = (p * (log_p - log_q)).sum(-1)
    tv = 0.5 * (p - q).abs().sum(-1)
    if name == "kl":
        return kl, kl
    if name == "tv":
        return tv, kl
    if name == "lk":
        blend = torch.exp(-ETA * (1 - tv)).detach()
        return blend * kl + (1 - blend) * tv, kl
    return -torch.log(1 - tv), kl


def test_the_config_offers_exactly_the_losses_implemented():
    assert typing.get_args(TrainConfig.model_fields["loss"].annotation) == tuple(LOSSES)
    with pytest.raises(ValueError, match="unknown loss 'js'"):
        Objective("js")


def test_losses_of_a_worked_example():
    """p = (1/2, 1/2, 0), q = (1/4, 1/4, 1/2): overlap 1/2, KL = log 2, by hand."""
    p = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.25, 0.25, 0.5]], dtype=torch.float64)
    alpha, kl = acceptance(p, q), torch.tensor([math.log(2)], dtype=torch.float64)
    assert alpha.item() == 0.5
    blend = math.exp(-ETA * 0.5)
    want = {"kl": math.log(2), "tv": 0.5, "lk": blend * math.log(2) + (1 - blend) * 0.5, "lk_alpha": math.log(2)}
    for name, value in want.items():
        assert Objective(name, ETA).row_loss(kl, alpha).item() == pytest.approx(value, rel=1e-15), name


def test_lk_alpha_is_cross_entropy_at_a_one_hot_target_and_zero_at_the_target():
    gen = torch.Generator().manual_seed(0)
    q = torch.softmax(torch.randn(5, 11, generator=gen, dtype=torch.float64), -1)
    labels = torch.randint(0, 11, (5,), generator=gen)
    one_hot = torch.nn.functional.one_hot(labels, 11).double()
    lk_alpha = Objective("lk_alpha").row_loss(None, acceptance(one_hot, q))
    torch.testing.assert_close(lk_alpha, torch.nn.functional.nll_loss(q.log(), labels, reduction="none"))
    for name in ("tv", "lk", "lk_alpha"):  # the draft equal to the verifier: nothing left to learn
        assert torch.allclose(Objective(name).row_loss(torch.zeros(5, dtype=torch.float64), acceptance(q, q)),
                              torch.zeros(5, dtype=torch.float64), atol=1e-15), name


def random_head(seed: int, rows: int = 37, width: int = 24, vocab: int = 50):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64) * 0.5
    targets = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2
    row_weight = (torch.rand(rows, generator=gen) < 0.7).double() / 20
    return hidden, weight, targets, row_weight


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("chunk_rows", [1, 7, 16, 100])
def test_chunked_head_loss_equals_autograd_of_the_definition(name, chunk_rows):
    """The analytic gradient of the chunked path (loss.py's docstring) against autograd of reference_row_loss."""
    hidden, weight, targets, row_weight = random_head(chunk_rows)
    upstream = 1.7  # the backward scales by the incoming gradient

    ours_h, ours_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, row_loss, kl, top1 = chunked_head_loss(ours_h, ours_w, targets, row_weight, chunk_rows, Objective(name, ETA))
    (upstream * loss).backward()
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_row_loss, ref_kl = reference_row_loss(name, torch.log_softmax(targets, -1),
                                              torch.log_softmax(ref_h @ ref_w.T, -1))
    ref_loss = (ref_row_loss * row_weight).sum()
    (upstream * ref_loss).backward()

    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(row_loss, ref_row_loss.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, ref_kl.detach(), rtol=1e-12, atol=1e-12)
    assert torch.equal(top1, (hidden @ weight.T).argmax(-1))
    assert ref_h.grad.abs().max() > 1e-3  # a gradient worth comparing
    torch.testing.assert_close(ours_h.grad, ref_h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours_w.grad, ref_w.grad, rtol=1e-10, atol=1e-12)


def test_lk_alpha_has_no_gradient_past_its_floor():
    """A row whose overlap is below 1e-5 contributes its floored loss and no gradient (speculators' clamp)."""
    weight = torch.eye(3, dtype=torch.float64) * 40
    hidden = torch.tensor([[1.0, 0, 0], [0, 1.0, 0]], dtype=torch.float64, requires_grad=True)
    targets = torch.tensor([[-40.0, 40, 0], [-40, 40, 0]], dtype=torch.float64)  # row 0: overlap ~ e^-40
    loss, row_loss, _, _ = chunked_head_loss(hidden, weight, targets, torch.ones(2, dtype=torch.float64), 1,
                                             Objective("lk_alpha"))
    loss.backward()
    assert row_loss[0].item() == pytest.approx(-math.log(1e-5))
    assert hidden.grad[0].abs().max() == 0 and torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("name", list(LOSSES))
def test_plain_loss_is_the_counted_mean_of_the_definition(name):
    """VerifierTargets.distill (the plain path, autograd through torch.minimum) against reference_row_loss."""
    gen = torch.Generator().manual_seed(3)
    verifier = torch.randn(2, 9, 30, generator=gen)
    draft = torch.randn(2, 9, 30, generator=gen, dtype=torch.float64)
    loss_mask = torch.rand(2, 9, generator=gen) < 0.7
    document_ids = torch.tensor([[0] * 5 + [1] * 4, [0] * 9])
    step = 1
    ours = draft.clone().requires_grad_()
    loss, stats, _ = VerifierTargets(verifier, Objective(name, ETA)).distill(ours, loss_mask, document_ids, step)
    loss.backward()

    counted = VerifierTargets.counted(loss_mask, document_ids, step)
    ref = draft.clone().requires_grad_()
    row_loss, kl = reference_row_loss(name, torch.log_softmax(verifier[:, step:].double(), -1),
                                      torch.log_softmax(ref[:, :-step], -1))
    ref_loss = (row_loss * counted).sum() / counted.sum()
    ref_loss.backward()
    # the plain path takes both softmaxes in float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, check_dtype=False)
    torch.testing.assert_close(ours.grad, ref.grad, rtol=1e-4, atol=1e-6)
    assert stats[3].item() == pytest.approx((row_loss * counted).sum().item(), rel=1e-5)
    assert stats[0].item() == pytest.approx((kl * counted).sum().item(), rel=1e-5)


@pytest.mark.parametrize("name", list(LOSSES))
def test_draft_with_chunked_loss_equals_the_plain_loss(name):
    """The whole TTT forward/backward with train.loss_chunk_rows: same loss, statistics and gradients."""
    batch = packed([9, 12], 24, seed=4)
    results = []
    for chunk_rows in (None, 5):
        model = tiny_model()
        model.loss_chunk_rows, model.objective = chunk_rows, Objective(name, ETA)
        loss, stats, _ = model(**batch, ttt_steps=3, step_weights=[1.0, 0.7, 0.4])
        loss.backward()
        results.append((loss, stats, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain_loss, plain_stats, plain_grads), (loss, stats, grads) = results
    # the plain loss takes its softmax in float32 (`.float()`), the chunked one in the inputs' float64
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-7, check_dtype=False)
    torch.testing.assert_close(stats, plain_stats, rtol=1e-6, atol=1e-6, check_dtype=False)
    assert grads.keys() == plain_grads.keys()
    for param, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[param], rtol=1e-5, atol=1e-7, msg=param)


def test_chunked_loss_leaves_the_logits_of_step_by_step_drafting_unchanged():
    model = tiny_model()
    batch = packed([20], 24)
    with torch.no_grad():
        plain_loss = step_logits(model, batch)[1]
        model.loss_chunk_rows = 8
        assert float(model(**batch, ttt_steps=3, step_weights=[1.0] * 3)[0]) == pytest.approx(float(plain_loss))


def test_train_options_reach_the_draft():
    from eagle3_pipeline.config import load_config
    from eagle3_pipeline.train.draft_model import Eagle3Draft, accelerate_draft
    from tests.conftest import CONFIGS

    train = load_config(CONFIGS / "tiny_kimi.yaml").train.model_copy(
        update={"loss_chunk_rows": 64, "compile": True, "loss": "lk", "lk_eta": ETA})
    model = tiny_model()
    assert model.objective == Objective("kl")  # the default
    accelerate_draft(model, train, torch.device("cpu"))
    assert model.loss_chunk_rows == 64 and model.objective == Objective("lk", ETA)
    assert model.unroll.__func__ is Eagle3Draft.unroll  # compile acts on GPUs only


def test_fp8_is_refused_where_it_cannot_run():
    from eagle3_pipeline.config import ConfigError, load_config
    from eagle3_pipeline.train.draft_model import accelerate_draft
    from tests.conftest import CONFIGS

    train = load_config(CONFIGS / "tiny_kimi.yaml").train.model_copy(update={"fp8": True})
    with pytest.raises(ConfigError, match="train.fp8"):  # no torchao here, or no float8 units on a CPU
        accelerate_draft(tiny_model(), train, torch.device("cpu"))
