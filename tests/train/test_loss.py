"""The fused, chunked head + KL loss equals the plain computation in value and gradients (CPU, float64)."""

from __future__ import annotations

import pytest
import torch

from eagle3_pipeline.train.loss import chunked_head_kl
from tests.train.test_draft_model import packed, step_logits, tiny_model


def plain_head_kl(hidden, weight, target_logits, row_weight):
    """The unfused reference: full logits, log-softmax of both, KL(p || q) per row."""
    log_q = torch.log_softmax(hidden @ weight.T, dim=-1)
    log_p = torch.log_softmax(target_logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    return (kl * row_weight).sum(), kl


@pytest.mark.parametrize("chunk_rows", [1, 7, 16, 100])
def test_chunked_head_kl_equals_the_plain_computation(chunk_rows):
    gen = torch.Generator().manual_seed(chunk_rows)
    rows, width, vocab = 37, 24, 50
    hidden = torch.randn(rows, width, generator=gen, dtype=torch.float64)
    weight = torch.randn(vocab, width, generator=gen, dtype=torch.float64) * 0.5
    targets = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2
    row_weight = (torch.rand(rows, generator=gen) < 0.7).double() / 20
    upstream = 1.7  # the backward scales by the incoming gradient

    ours_h, ours_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, kl, top1 = chunked_head_kl(ours_h, ours_w, targets, row_weight, chunk_rows)
    (upstream * loss).backward()
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_loss, ref_kl = plain_head_kl(ref_h, ref_w, targets, row_weight)
    (upstream * ref_loss).backward()

    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(kl, ref_kl, rtol=1e-12, atol=1e-12)
    assert torch.equal(top1, (hidden @ weight.T).argmax(-1))
    torch.testing.assert_close(ours_h.grad, ref_h.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours_w.grad, ref_w.grad, rtol=1e-10, atol=1e-12)


def test_draft_with_chunked_loss_equals_the_plain_loss():
    """The whole TTT forward/backward with train.loss_chunk_rows: same loss, statistics and gradients."""
    batch = packed([9, 12], 24, seed=4)
    results = []
    for chunk_rows in (None, 5):
        model = tiny_model()
        model.loss_chunk_rows = chunk_rows
        loss, stats, _ = model(**batch, ttt_steps=3, step_weights=[1.0, 0.7, 0.4])
        loss.backward()
        results.append((loss, stats, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain_loss, plain_stats, plain_grads), (loss, stats, grads) = results
    # the plain loss takes its softmax in float32 (`.float()`), the chunked one in the inputs' float64
    torch.testing.assert_close(loss, plain_loss, rtol=1e-6, atol=1e-7, check_dtype=False)
    torch.testing.assert_close(stats, plain_stats, rtol=1e-6, atol=1e-6, check_dtype=False)
    assert grads.keys() == plain_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


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

    train = load_config(CONFIGS / "tiny_kimi.yaml").train.model_copy(update={"loss_chunk_rows": 64, "compile": True})
    model = tiny_model()
    accelerate_draft(model, train, torch.device("cpu"))
    assert model.loss_chunk_rows == 64
    assert model.unroll.__func__ is Eagle3Draft.unroll  # compile acts on GPUs only


def test_fp8_is_refused_where_it_cannot_run():
    from eagle3_pipeline.config import ConfigError, load_config
    from eagle3_pipeline.train.draft_model import accelerate_draft
    from tests.conftest import CONFIGS

    train = load_config(CONFIGS / "tiny_kimi.yaml").train.model_copy(update={"fp8": True})
    with pytest.raises(ConfigError, match="train.fp8"):  # no torchao here, or no float8 units on a CPU
        accelerate_draft(tiny_model(), train, torch.device("cpu"))
