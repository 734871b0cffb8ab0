"""The exported draft in vLLM's own Eagle-3 model computes what 04's training forward computes, for the reference
layout and for EAGLE 3.1 (`fc_norm` + `norm_output`); an EAGLE 3.1 export missing an fc_norm tensor loads in
vLLM without a word, and both 06's static check and its weights probe report it.

vLLM's `Eagle3LlamaForCausalLM` is built in this process from the engine config vLLM derives for SmolLM2 with the
export as its draft, loads the export with its own `load_weights` (names, `midlayer.` renaming, d2t, the 3.1
keys read from config.json), and runs its `combine_hidden_states`, decoder layer, norms and head. Only the
attention kernel, which needs an engine's scheduler metadata, is replaced: a causal attention over the keys
kept so far (the draft's KV cache of one request). Drafting as vLLM does it for row r: one pass over rows
0..r, then per later step the next token and the previous step's hidden state output (`aux_output`).
"""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.export.format import export_state_dict, read_spec, reference_config
from eagle3_pipeline.train.draft_model import build_draft, load_frozen_and_vocab
from eagle3_pipeline.train.verifier import VerifierWeights
from eagle3_pipeline.validate import weights_probe
from eagle3_pipeline.validate.compare import BREAKING, static_differences
from tests.train.test_draft_model import step_logits

AUX_IDS, ROWS, STEPS, DRAFT_VOCAB = [2, 15, 27], 12, 3, 64
EAGLE31 = {"fc_norm": True, "norm_output": True}
# draft.attention mla; vLLM's CPU MLA backend takes latents of kv_lora_rank + qk_rope_head_dim = 576 only
MLA = {"attention": "mla", "q_lora_rank": 96, "kv_lora_rank": 512, "qk_nope_head_dim": 32, "qk_rope_head_dim": 64,
       "v_head_dim": 48}
LAYOUTS = {"reference": {}, "eagle31": EAGLE31, "mla": MLA, "mla-eagle31": {**MLA, **EAGLE31}}


class CachedLatentAttention(torch.nn.Module):
    """vLLM's MLA attention for one request, in its expanded form: kv_b_proj turns each kept latent into every
    head's key (with the shared rotary part) and value; then as CachedCausalAttention."""

    def __init__(self, attention):
        super().__init__()
        self.attention, self.latents, self.rotary = attention, None, None

    def forward(self, q, kv_c_normed, k_pe, output_shape, **_):
        a, new = self.attention, q.shape[0]
        self.latents = kv_c_normed if self.latents is None else torch.cat([self.latents, kv_c_normed])
        self.rotary = k_pe if self.rotary is None else torch.cat([self.rotary, k_pe])
        total = self.latents.shape[0]
        expanded = a.kv_b_proj(self.latents)[0].view(total, a.num_heads, a.qk_nope_head_dim + a.v_head_dim)
        k_nope, values = expanded.split([a.qk_nope_head_dim, a.v_head_dim], dim=-1)
        keys = torch.cat([k_nope, self.rotary.expand(-1, a.num_heads, -1)], dim=-1)
        visible = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=visible, scale=a.scaling)
        return out.transpose(0, 1).reshape(output_shape)


class CachedCausalAttention(torch.nn.Module):
    """vLLM's attention for one request: new queries attend causally to every key kept so far and to their own."""

    def __init__(self, heads: int, kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.scale = heads, kv_heads, head_dim, scale
        self.keys = self.values = None

    def forward(self, q, k, v):
        new = q.shape[0]
        k, v = (x.view(new, self.kv_heads, self.head_dim) for x in (k, v))
        self.keys = k if self.keys is None else torch.cat([self.keys, k])
        self.values = v if self.values is None else torch.cat([self.values, v])
        total = self.keys.shape[0]
        groups = self.heads // self.kv_heads
        keys, values = (x.repeat_interleave(groups, dim=1).transpose(0, 1) for x in (self.keys, self.values))
        visible = torch.arange(total)[None, :] <= torch.arange(total - new, total)[:, None]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.view(new, self.heads, self.head_dim).transpose(0, 1), keys, values, attn_mask=visible, scale=self.scale)
        return out.transpose(0, 1).reshape(new, self.heads * self.head_dim)


def trained_looking_draft(hidden: int, vocab: int, flags: dict):
    """A draft of SmolLM2's width with random weights, bf16-exact (what the export stores), norms away from ones."""
    torch.manual_seed(0)
    draft = SimpleNamespace(hidden_size=hidden, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            intermediate_size=128, draft_vocab_size=DRAFT_VOCAB, rope_theta=10000.0,
                            rope_scaling=None, max_position_embeddings=256, rms_norm_eps=1e-6,
                            norm_before_residual=False, norm_before_fc=False, norm_output=False, fc_norm=False,
                            attention="llama", q_lora_rank=None, kv_lora_rank=None, qk_nope_head_dim=None,
                            qk_rope_head_dim=None, v_head_dim=None)
    draft.__dict__.update(flags)
    model = build_draft(draft, AUX_IDS, vocab, "sdpa")
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[torch.randperm(vocab)[:DRAFT_VOCAB]] = True
    d2t = t2d.nonzero().squeeze(1) - torch.arange(DRAFT_VOCAB)
    load_frozen_and_vocab(model, VerifierWeights(torch.randn(vocab, hidden), torch.ones(hidden),
                                                 torch.randn(vocab, hidden), 1e-5, False), d2t, t2d)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
            if name.endswith("o_proj.weight"):  # attention's share of the output as large as fc's: a wrong
                parameter.mul_(64)  # attention (rope, scale, masks) shows in the logits; x 2^6 stays bf16-exact
            parameter.copy_(parameter.to(torch.bfloat16))
    return draft, model


def export_folder(folder, draft, model, vocab: int):
    """The reference-format folder 05 writes (its config.json and tensor names), bf16."""
    folder.mkdir(parents=True)
    config = reference_config(draft, {"vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2}, AUX_IDS, 256)
    (folder / "config.json").write_text(json.dumps(config))
    state = export_state_dict(model.state_dict(), "reference")
    save_file({name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in state.items()},
              str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def vllm_distributed():
    """vLLM's single-process model parallel state, which its layers read when built (set up by `vllm_draft`,
    which needs a vLLM config to do it), torn down after this module."""
    from vllm.distributed import destroy_distributed_environment, destroy_model_parallel

    yield
    destroy_model_parallel()
    destroy_distributed_environment()


def start_model_parallel() -> None:
    from vllm.distributed import init_distributed_environment, initialize_model_parallel, model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)


def vllm_draft(target, folder, model):
    """vLLM's Eagle-3 draft for `folder`, built and loaded as its engine does; the embedding is the target's in
    vLLM (shared at load), here the draft's frozen copy of it."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    mla = model.config.transformer_layer_config.model_type == "deepseek_v3"
    served_class = Eagle3DeepseekV2ForCausalLM if mla else Eagle3LlamaForCausalLM
    # vLLM CPU prefers its AMX MLA backend where the processor has AMX, and that packs no fp32 weights
    # (eagle3_pipeline/engine.py asks for the reference backend the same way)
    config = EngineArgs(model=str(target), dtype="float32", max_model_len=256, enforce_eager=True,
                        attention_backend="CPU_MLA" if mla else None,
                        speculative_config={"method": "eagle3", "model": str(folder), "num_speculative_tokens": STEPS},
                        ).create_engine_config()
    with set_current_vllm_config(config):
        start_model_parallel()
        served = served_class(vllm_config=config)
        served.load_weights(load_file(str(folder / "model.safetensors")).items())
        served.model.embed_tokens.weight.data.copy_(model.embed_tokens.weight.data)
        process_weights_after_loading(served, config.model_config, torch.device("cpu"))
    return config, served


def vllm_drafted_logits(config, served, aux, ids, row: int) -> list[torch.Tensor]:
    """vLLM's draft logits over the draft vocab at each step of the chain drafted after row `row`."""
    from vllm.config import set_current_vllm_config

    attention = served.model.layers[0].self_attn
    if hasattr(attention, "mla_attn"):  # DeepseekV2MLAAttention: the wrapper's kernel call
        attention.mla_attn.mla_attn = CachedLatentAttention(attention)
        # vLLM CPU's rotary kernel (forward_cpu) turns the MLA query's pairs otherwise than its own
        # forward_native, which the GPU kernels and transformers agree with: the reference here is forward_native
        attention.rotary_emb._forward_method = attention.rotary_emb.forward_native
    else:
        attention.attn = CachedCausalAttention(attention.num_heads, attention.num_kv_heads, attention.head_dim,
                                               attention.scaling)
    kept = torch.arange(DRAFT_VOCAB) + served.draft_id_to_target_id  # the draft vocab's target ids
    logits = []
    with set_current_vllm_config(config), torch.no_grad():
        positions = torch.arange(row + 1)
        hidden = served.combine_hidden_states(aux[: row + 1])
        for step in range(STEPS):
            out, hidden = served.model(ids[positions], positions, hidden)
            logits.append(served.compute_logits(out[-1:])[0, kept])
            positions, hidden = torch.tensor([row + step + 1]), hidden[-1:]
    return logits


@pytest.mark.vllm
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_serves_what_training_computes(layout, smollm2_dir, vllm_distributed, tmp_path):
    target_config = json.loads((smollm2_dir / "config.json").read_text())
    hidden, vocab = target_config["hidden_size"], target_config["vocab_size"]
    draft, model = trained_looking_draft(hidden, vocab, LAYOUTS[layout])
    folder = export_folder(tmp_path / "draft", draft, model, vocab)
    config, served = vllm_draft(smollm2_dir, folder, model)
    assert (served.model.fc_norm is not None, served.model.norm_output) == (draft.fc_norm, draft.norm_output)

    gen = torch.Generator().manual_seed(1)
    # aux states of very different sizes, as a target's early and late layers have: fc_norm evens them out
    aux = torch.cat([s * torch.randn(ROWS + STEPS, hidden, generator=gen) for s in (0.5, 8.0, 60.0)], dim=-1)
    ids = torch.randint(0, vocab, (ROWS + STEPS,), generator=gen)
    batch = {"aux": aux[None, :ROWS], "final": torch.randn(1, ROWS, hidden, generator=gen),
             "input_ids": ids[None, :ROWS], "position_ids": torch.arange(ROWS)[None],
             "document_ids": torch.zeros(1, ROWS, dtype=torch.long), "loss_mask": torch.ones(1, ROWS, dtype=torch.bool)}
    with torch.no_grad():
        trained = step_logits(model, batch, STEPS)[0]
    for row in (0, 4, ROWS - STEPS):
        for step, served_logits in enumerate(vllm_drafted_logits(config, served, aux, ids, row)):
            torch.testing.assert_close(served_logits, trained[step][0, row], rtol=2e-4, atol=2e-4,
                                       msg=lambda m, row=row, step=step: f"row {row} step {step}: {m}")


@pytest.mark.vllm
def test_a_missing_fc_norm_tensor_is_reported_by_the_static_check_and_the_weights_probe(smollm2_dir, vllm_distributed,
                                                                                       tmp_path):
    target_config = json.loads((smollm2_dir / "config.json").read_text())
    hidden, vocab = target_config["hidden_size"], target_config["vocab_size"]
    draft, model = trained_looking_draft(hidden, vocab, LAYOUTS["eagle31"])
    folder = export_folder(tmp_path / "draft", draft, model, vocab)
    state = load_file(str(folder / "model.safetensors"))
    del state["fc_norm.1.weight"]
    save_file(state, str(folder / "model.safetensors"))

    # against its own spec: only the config.json's fc_norm can tell that the tensor is missing
    differences = static_differences(folder, read_spec(folder), 256)
    assert [(d.kind, d.where) for d in differences] == [(BREAKING, "tensor fc_norm.1.weight")]
    assert "vLLM does not check it and runs the norm with its initial weight of ones" in differences[0].message

    loads = len(weights_probe._loads)
    _, served = vllm_draft(smollm2_dir, folder, model)  # loads without complaint
    assert served.model.fc_norm[1].weight.eq(1).all()
    report = {"loads": weights_probe._loads[loads:], "shared": ["model.embed_tokens.weight"]}
    required = weights_probe.flagged_norms(json.loads((folder / "config.json").read_text()))
    assert required == [f"model.fc_norm.{i}.weight" for i in range(3)]
    assert weights_probe.skipped_parameters(report, required) == (["model.fc_norm.1.weight"], ["t2d"])
