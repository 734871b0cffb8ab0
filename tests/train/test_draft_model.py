"""The draft: reference shapes and names, and a TTT forward equal to vLLM-style step-by-step drafting."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from eagle3_pipeline.config import load_config
from eagle3_pipeline.export.format import export_state_dict
from eagle3_pipeline.reference import REFERENCE_DRAFT_SPEC
from eagle3_pipeline.train.attention import ttt_masks
from eagle3_pipeline.train.draft_model import build_draft, load_frozen_and_vocab
from eagle3_pipeline.train.verifier import VerifierWeights
from tests.conftest import CONFIGS

REFERENCE = json.loads(REFERENCE_DRAFT_SPEC.read_text())


def test_kimi_draft_has_exactly_the_reference_tensors():
    draft = load_config(CONFIGS / "kimi_k25.yaml").draft
    with torch.device("meta"):  # shapes only: the real draft is 1.2 B parameters + a 163840 x 7168 embedding
        model = build_draft(draft, [2, 30, 58], 163840, "sdpa")
    ours = {name: list(t.shape) for name, t in export_state_dict(model.state_dict(), "reference").items()}
    assert ours == {name: spec["shape"] for name, spec in REFERENCE["tensors"].items()}
    assert ours["midlayer.self_attn.q_proj.weight"] == [64 * 128, 2 * 7168]  # 8192, not 7168


def test_tiny_kimi_draft_attention_is_heads_times_head_dim():
    draft = load_config(CONFIGS / "tiny_kimi.yaml").draft
    with torch.device("meta"):
        state = build_draft(draft, [2, 4, 5], 163840, "sdpa").state_dict()
    for proj in "qkv":
        assert tuple(state[f"layers.0.self_attn.{proj}_proj.weight"].shape) == (4 * 128, 2 * 256)
    assert tuple(state["layers.0.self_attn.o_proj.weight"].shape) == (256, 4 * 128)
    assert tuple(state["fc.weight"].shape) == (256, 3 * 256)
    assert tuple(state["lm_head.weight"].shape) == (2048, 256)


def test_speculators_defaults_are_overridden_to_the_reference_semantics():
    draft = load_config(CONFIGS / "tiny_kimi.yaml").draft
    with torch.device("meta"):
        model = build_draft(draft, [2, 4, 5], 163840, "sdpa")
    config = model.config
    assert (config.norm_before_fc, config.fc_norm, config.norm_output, config.norm_before_residual) == (False,) * 4
    assert model.input_norm is None and model.fc_norm is None
    assert not model.uses_sliding_window_attn
    assert config.transformer_layer_config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}


# --------------------------------------------------------------------------------- TTT forward semantics
HIDDEN, VOCAB, DRAFT_VOCAB, AUX = 32, 96, 48, 3
DRAFT = SimpleNamespace(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        intermediate_size=64, draft_vocab_size=DRAFT_VOCAB, rope_theta=10000.0, rope_scaling=None,
                        max_position_embeddings=256, rms_norm_eps=1e-6, norm_before_residual=False,
                        norm_before_fc=False, norm_output=False, fc_norm=False, attention="llama",
                        q_lora_rank=None, kv_lora_rank=None, qk_nope_head_dim=None, qk_rope_head_dim=None,
                        v_head_dim=None)
# draft.attention mla at the tiny size: qk head 8 + 8, values 12, latents 16, query rank 24
MLA = {"attention": "mla", "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
       "v_head_dim": 12}


def tiny_model(implementation: str = "sdpa", **flags):
    torch.manual_seed(0)
    model = build_draft(SimpleNamespace(**{**vars(DRAFT), **flags}), [1, 2, 3], VOCAB, implementation).double()
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.randperm(VOCAB)[:DRAFT_VOCAB]] = True
    d2t = t2d.nonzero().squeeze(1) - torch.arange(DRAFT_VOCAB)
    verifier = VerifierWeights(torch.randn(VOCAB, HIDDEN).double(), 1 + 0.1 * torch.randn(HIDDEN).double(),
                               torch.randn(VOCAB, HIDDEN).double() * 0.3, 1e-5, False)
    load_frozen_and_vocab(model, verifier, d2t, t2d)
    return model


def packed(documents: list[int], length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A packed row of documents with these row counts, then padding, in data.py's layout."""
    gen = torch.Generator().manual_seed(seed)
    batch = {"aux": torch.zeros(1, length, AUX * HIDDEN, dtype=torch.float64),
             "final": torch.zeros(1, length, HIDDEN, dtype=torch.float64),
             "input_ids": torch.zeros(1, length, dtype=torch.long),
             "position_ids": torch.zeros(1, length, dtype=torch.long),
             "document_ids": torch.full((1, length), -1),
             "loss_mask": torch.zeros(1, length, dtype=torch.bool)}
    start = 0
    for doc, rows in enumerate(documents):
        span = slice(start, start + rows)
        batch["aux"][0, span] = torch.randn(rows, AUX * HIDDEN, generator=gen, dtype=torch.float64)
        batch["final"][0, span] = torch.randn(rows, HIDDEN, generator=gen, dtype=torch.float64)
        batch["input_ids"][0, span] = torch.randint(0, VOCAB, (rows,), generator=gen)
        batch["position_ids"][0, span] = torch.arange(rows)
        batch["document_ids"][0, span] = doc
        batch["loss_mask"][0, span] = torch.rand(rows, generator=gen) < 0.8
        start += rows
    return batch


def step_logits(model, batch, ttt_steps=3):
    """The draft's logits at every TTT step (captured from lm_head)."""
    captured = []
    handle = model.lm_head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    loss, stats, _ = model(**batch, ttt_steps=ttt_steps, step_weights=[1.0] * ttt_steps)
    handle.remove()
    return captured, loss, stats


def drafted_logits(model, batch, row: int, ttt_steps: int):
    """What vLLM's draft computes: a causal pass over rows 0..row, then one token per step with a KV cache.

    (eager attention takes its softmax in float32, hence the 1e-6 tolerance below.)
    """
    from transformers import DynamicCache

    layer, cache = model.layers[0], DynamicCache()
    ids, positions = batch["input_ids"][:, : row + 1], batch["position_ids"][:, : row + 1]
    aux = batch["aux"][:, : row + 1]
    hidden = torch.cat([model.embed_tokens(ids), model.fc(aux if model.input_norm is None else model.input_norm(aux))],
                       dim=-1)
    implementation = model.config.transformer_layer_config._attn_implementation
    causal = ttt_masks(torch.zeros(1, row + 1, dtype=torch.long), 1, implementation)[0]  # one document
    hidden = layer(hidden, attention_mask=causal, past_key_values=cache,
                   position_embeddings=model.rotary_emb(hidden, positions))[:, -1:]
    normed = model.norm(hidden)
    logits = [model.lm_head(normed)]
    hidden = normed if model.config.norm_output else hidden  # what vLLM hands the next step
    for step in range(1, ttt_steps):
        token = batch["input_ids"][:, row + step: row + step + 1]  # the token drafted (and accepted) before
        position = batch["position_ids"][:, row: row + 1] + step
        hidden = torch.cat([model.embed_tokens(token), hidden], dim=-1)
        hidden = layer(hidden, attention_mask=None, past_key_values=cache,
                       position_embeddings=model.rotary_emb(hidden, position))
        normed = model.norm(hidden)
        logits.append(model.lm_head(normed))
        hidden = normed if model.config.norm_output else hidden
    return [lg[0, -1] for lg in logits]


@pytest.mark.parametrize("implementation,flags", [("sdpa", {}), ("eager", {}),
                                                  ("sdpa", {"norm_before_fc": True, "norm_output": True}),
                                                  ("sdpa", MLA), ("eager", {**MLA, "norm_output": True})])
def test_ttt_forward_equals_step_by_step_drafting(implementation, flags):
    model = tiny_model(implementation, **flags)
    assert (model.input_norm is not None) == flags.get("norm_before_fc", False)
    assert model.config.transformer_layer_config.model_type == {"llama": "llama", "mla": "deepseek_v3"}[
        flags.get("attention", "llama")]
    batch = packed([20], 24)
    with torch.no_grad():
        trained, _, _ = step_logits(model, batch)
        for row in (0, 5, 16):
            drafted = drafted_logits(model, batch, row, 3)
            for step in range(3):
                torch.testing.assert_close(trained[step][0, row], drafted[step], rtol=1e-6, atol=1e-6)


def test_packed_documents_do_not_see_each_other():
    model = tiny_model()
    together, alone = packed([9, 12], 24, seed=1), packed([12], 24, seed=1)
    for name in ("aux", "final", "input_ids", "loss_mask"):  # the second document alone, same values
        alone[name][0, :12] = together[name][0, 9:21]
    with torch.no_grad():
        logits_together = step_logits(model, together)[0]
        logits_alone = step_logits(model, alone)[0]
    for step in range(3):
        torch.testing.assert_close(logits_together[step][0, 9:21], logits_alone[step][0, :12])


def test_step_k_counts_rows_whose_target_is_k_rows_on_in_the_same_document():
    model = tiny_model()
    batch = packed([7, 10], 20, seed=2)
    batch["loss_mask"] = batch["document_ids"] >= 0
    with torch.no_grad():
        _, loss, stats = step_logits(model, batch)
    # step k: a document of n rows has n - k rows whose target row lies inside it
    assert stats[2].tolist() == [17.0, 15.0, 13.0]
    assert float(loss) == pytest.approx(float((stats[0] / stats[2]).sum()))


def test_loss_trains_fc_layer_norm_and_lm_head_only():
    model = tiny_model()
    loss, _, _ = model(**packed([12], 16), ttt_steps=2, step_weights=[1.0, 0.5])
    loss.backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad == {name for name, p in model.named_parameters() if p.requires_grad}
    assert {"fc.weight", "lm_head.weight", "norm.weight", "layers.0.hidden_norm.weight"} <= with_grad
    assert not {"embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"} & with_grad


def test_flex_block_masks_keep_exactly_the_dense_masks():
    from eagle3_pipeline.train.attention import FLEX

    document_ids = torch.tensor([[0] * 150 + [1] * 70 + [-1] * 36, [0] * 256])
    dense = ttt_masks(document_ids, 3, "sdpa")
    for step, block in enumerate(ttt_masks(document_ids, 3, FLEX)):  # step 0 built, later steps extended
        kv = (step + 1) * 256
        assert torch.equal(create_mask(block.mask_mod, 2, 1, 256, kv, device="cpu"), dense[step].expand(2, 1, 256, kv))
        occupied = dense[step].view(2, 1, 2, 128, step + 1, 2, 128).flatten(4, 5).any(dim=(3, 5))
        assert torch.equal(block.to_dense().bool(), occupied)  # the blocks the kernel visits


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_path_computes_what_sdpa_computes(monkeypatch):
    """The GPU path's wiring (layouts, GQA, scale, block masks) on CPU, with flex attention uncompiled."""
    from torch.nn.attention.flex_attention import flex_attention
    from transformers import AttentionInterface

    from eagle3_pipeline.train import attention

    monkeypatch.setattr(attention, "_compiled_flex_attention", flex_attention)
    AttentionInterface.register(attention.FLEX, attention._flex_attention_forward)
    batch = {k: v.float() if v.is_floating_point() else v for k, v in packed([70, 40], 128, seed=3).items()}
    with torch.no_grad():
        flex = step_logits(tiny_model(attention.FLEX).float(), batch)[0]
        sdpa = step_logits(tiny_model("sdpa").float(), batch)[0]
    for step in range(3):
        torch.testing.assert_close(flex[step], sdpa[step], rtol=1e-4, atol=1e-4)


def test_standardized_aux_folds_into_fc_at_export():
    from eagle3_pipeline.draft_spec import stored_tensors
    from eagle3_pipeline.export.format import fold_aux_scale
    from eagle3_pipeline.train.draft_model import standardize_aux

    scaled = tiny_model()
    scaled.register_buffer("aux_scale", torch.ones(AUX * HIDDEN, dtype=torch.float64))
    batch = packed([10, 9], 24, seed=3)
    batch["aux"] *= torch.logspace(-1, 2, AUX * HIDDEN, dtype=torch.float64)  # channels of very different sizes
    standardize_aux(scaled, [batch], SimpleNamespace(reduce=lambda tensor, _op: tensor))
    real = batch["aux"][batch["document_ids"] >= 0]
    torch.testing.assert_close((real * scaled.aux_scale).square().mean(0).sqrt(), torch.ones(AUX * HIDDEN,
                               dtype=torch.float64))  # every channel at RMS 1 (none under the 1% floor here)

    exported = tiny_model()  # the same initial weights, no aux_scale: what vLLM runs
    exported.load_state_dict(fold_aux_scale(stored_tensors(scaled.state_dict())), strict=False)
    with torch.no_grad():
        for ours, served in zip(step_logits(scaled, batch)[0], step_logits(exported, batch)[0]):
            torch.testing.assert_close(ours, served)
    assert not torch.equal(exported.fc.weight, tiny_model().fc.weight)
