"""A tiny, random, deterministic stand-in for Kimi-K2.5 (`KimiK25ForConditionalGeneration`).

`build(out_dir)` writes a model folder shaped like the real checkpoint, small enough for a CPU:
a MoonViT vision tower (1 block) and a DeepSeek-V3 text model (MLA + MoE, 8 layers, hidden 256,
Kimi's real vocabulary size 163840), bf16 weights in 3 safetensors shards with Moonshot tensor
names, a byte-level BPE tokenizer with Kimi's special tokens at their real ids, and Kimi-K2.5's
chat template. vLLM loads it unmodified through its `KimiK25ForConditionalGeneration`;
transformers loads it without remote code through `AutoModelForImageTextToText` (the native
`Kimi_K25ForConditionalGeneration`).

The tokenizer comes in two forms with the same ids (`build(out_dir, tokenizer=...)`, one of TOKENIZERS),
both written by tiny_kimi_tokenizer.py.

Why the weights are written by hand instead of `Kimi_K25ForConditionalGeneration.save_pretrained`:
transformers 5.19 saves through the reverse of its `kimi_k25` key mapping, and that mapping's
unanchored vision rename `blocks -> layers` turns every text decoder key into
`language_model.model.blocks.N.*` (also `vision_tower.encoder.patch_embed.*`,
`model.mm_projector.pre_norm.*`). vLLM then fails with `KeyError: 'blocks.0.input_layernorm.weight'`
in the DeepSeek loader. The names below are the real checkpoint's, which both loaders accept.

Every byte depends only on this file, tiny_kimi_tokenizer.py, their assets and the library versions:
tensors come from per-name seeded generators, the BPE is trained on a fixed text.
"""

from __future__ import annotations

import base64
import io
import json
import pathlib
import zlib

import torch
from safetensors.torch import save_file

from eagle3_pipeline.stand_ins.tiny_kimi_tokenizer import (
    BOS_ID,
    EOS_ID,
    MEDIA_PAD_ID,
    PAD_ID,
    TOKENIZERS,
    VOCAB_SIZE,
    write_tokenizer,
)

SEED = 20260129

# --- Model shape: DeepSeek-V3 / Kimi-K2 text model, scaled down ---
# Written the way Moonshot's config.json writes it (model_type kimi_k2, rope_scaling): transformers'
# Kimi_K25Config and vLLM both convert it, as they do for the real checkpoint.
INIT_STD = 0.05  # matrices; above the usual 0.02 so logits and router scores spread (fewer near-ties)
TEXT_CONFIG = {
    "model_type": "kimi_k2",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "num_hidden_layers": 8,  # default EAGLE-3 aux ids (2, L//2, L-3) = (2, 4, 5) are distinct
    "first_k_dense_replace": 1,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_layer_freq": 1,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    # Kimi-K2.5's own MLA head dims: vLLM's CPU MLA needs kv_lora_rank + qk_rope_head_dim = 576, its GPU
    # prefill backends (FlashAttention, FlashInfer, TRT-LLM) accept only qk_nope 128 / rope 64 / v 128.
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "rms_norm_eps": 1e-05,
    "attention_bias": False,
    "num_nextn_predict_layers": 0,
    "initializer_range": INIT_STD,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}
VISION_CONFIG = {  # field names of transformers' Kimi_K25VisionConfig, which vLLM also reads
    "patch_size": 14,
    "pos_emb_height": 8,
    "pos_emb_width": 8,
    "pos_emb_time": 4,
    # the same under the real checkpoint's names, which vLLM 0.26's own KimiK25VisionConfig reads
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 4,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "hidden_act": "gelu_pytorch_tanh",
    "merge_kernel_size": [2, 2],
}
CONFIG = {
    "architectures": ["KimiK25ForConditionalGeneration"],
    "model_type": "kimi_k25",
    "text_config": TEXT_CONFIG,
    "vision_config": VISION_CONFIG,
    # transformers-only key: its projector's first LayerNorm width, i.e. the vision hidden size
    # (its default 1152 is the real vision width).
    "projection_hidden_size": VISION_CONFIG["hidden_size"],
    "media_placeholder_token_id": MEDIA_PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
# Read by vLLM's Kimi-K2.5 image processor; limits kept small so multimodal profiling stays cheap.
MEDIA_PROC_CFG = {
    "patch_size": VISION_CONFIG["patch_size"],
    "merge_kernel_size": 2,
    "temporal_merge_kernel_size": 4,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "in_patch_limit": 1024,
    "patch_limit_on_one_side": 64,
    "in_patch_limit_each_frame": 1024,
    "in_patch_limit_video": None,
    "fixed_output_tokens": None,
}
SHARD_NAMES = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]


def build(out_dir: pathlib.Path, tokenizer: str = "fast") -> None:
    """Write the stand-in into `out_dir` (an existing, empty folder), its tokenizer in form `tokenizer`
    (one of TOKENIZERS)."""
    import transformers

    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer {tokenizer!r}: expected one of {TOKENIZERS}")

    out_dir = pathlib.Path(out_dir)
    # transformers_version also tells transformers this is no Mistral tokenizer needing a regex fix
    _write_json(out_dir / "config.json", CONFIG | {"transformers_version": transformers.__version__})
    _write_json(out_dir / "preprocessor_config.json", {"media_proc_cfg": MEDIA_PROC_CFG})
    _write_weights(out_dir)
    write_tokenizer(out_dir, tokenizer, TEXT_CONFIG["max_position_embeddings"])


def _write_json(path: pathlib.Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# --- weights -----------------------------------------------------------------------------------


def _text_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of the text model, as in Moonshot's checkpoint (bf16 experts)."""
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    qk_head = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    shapes = {"language_model.model.embed_tokens.weight": (c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        p = f"language_model.model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_a_proj.weight": (c["q_lora_rank"], hidden),
            p + "self_attn.q_a_layernorm.weight": (c["q_lora_rank"],),
            p + "self_attn.q_b_proj.weight": (heads * qk_head, c["q_lora_rank"]),
            p + "self_attn.kv_a_proj_with_mqa.weight": (c["kv_lora_rank"] + c["qk_rope_head_dim"], hidden),
            p + "self_attn.kv_a_layernorm.weight": (c["kv_lora_rank"],),
            p + "self_attn.kv_b_proj.weight": (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]),
            p + "self_attn.o_proj.weight": (hidden, heads * c["v_head_dim"]),
        }
        if i < c["first_k_dense_replace"]:
            shapes |= _mlp_shapes(p + "mlp.", hidden, c["intermediate_size"])
            continue
        moe = c["moe_intermediate_size"]
        shapes[p + "mlp.gate.weight"] = (c["n_routed_experts"], hidden)
        shapes[p + "mlp.gate.e_score_correction_bias"] = (c["n_routed_experts"],)
        shapes |= _mlp_shapes(p + "mlp.shared_experts.", hidden, moe * c["n_shared_experts"])
        for e in range(c["n_routed_experts"]):
            shapes |= _mlp_shapes(p + f"mlp.experts.{e}.", hidden, moe)
    shapes["language_model.model.norm.weight"] = (hidden,)
    shapes["language_model.lm_head.weight"] = (c["vocab_size"], hidden)
    return shapes


def _mlp_shapes(prefix: str, hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    return {
        prefix + "gate_proj.weight": (inner, hidden),
        prefix + "up_proj.weight": (inner, hidden),
        prefix + "down_proj.weight": (hidden, inner),
    }


def _vision_shapes(v: dict, text_hidden: int) -> dict[str, tuple[int, ...]]:
    """MoonViT + projector names as in Moonshot's checkpoint (= vLLM's module names)."""
    d, p, inner = v["hidden_size"], v["patch_size"], v["intermediate_size"]
    merged = d * v["merge_kernel_size"][0] * v["merge_kernel_size"][1]
    shapes = {
        "vision_tower.patch_embed.proj.weight": (d, 3, p, p),
        "vision_tower.patch_embed.proj.bias": (d,),
        "vision_tower.patch_embed.pos_emb.weight": (v["pos_emb_height"], v["pos_emb_width"], d),
    }
    for i in range(v["num_hidden_layers"]):
        b = f"vision_tower.encoder.blocks.{i}."
        shapes |= _layer_norm(b + "norm0", d) | _layer_norm(b + "norm1", d)
        shapes |= _linear(b + "wqkv", d, 3 * d) | _linear(b + "wo", d, d)
        shapes |= _linear(b + "mlp.fc0", d, inner) | _linear(b + "mlp.fc1", inner, d)
    shapes |= _layer_norm("vision_tower.encoder.final_layernorm", d)
    shapes |= _layer_norm("mm_projector.pre_norm", d)
    shapes |= _linear("mm_projector.proj.0", merged, merged)
    shapes |= _linear("mm_projector.proj.2", merged, text_hidden)
    return shapes


def _linear(name: str, fan_in: int, fan_out: int) -> dict[str, tuple[int, ...]]:
    return {name + ".weight": (fan_out, fan_in), name + ".bias": (fan_out,)}


def _layer_norm(name: str, dim: int) -> dict[str, tuple[int, ...]]:
    return {name + ".weight": (dim,), name + ".bias": (dim,)}


def _init_tensor(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Norm scales 1, biases 0, everything else normal; seeded by name so order never matters."""
    if len(shape) == 1 and "norm" in name and name.endswith(".weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))
    if name.endswith("embed_tokens.weight"):
        std = 1.0  # unit-scale embeddings: every layer norms the residual stream before use
    elif name.endswith("e_score_correction_bias"):
        std = 0.1  # non-zero, so a loader that drops the router's bias changes the routing
    else:
        std = INIT_STD
    return (torch.randn(shape, generator=gen) * std).to(torch.bfloat16)


def _shard_of(name: str) -> str:
    """Embeddings and vision in shard 1, decoder layers in 2, final norm and lm_head in 3."""
    if name.startswith("language_model.model.layers."):
        return SHARD_NAMES[1]
    if name in ("language_model.model.norm.weight", "language_model.lm_head.weight"):
        return SHARD_NAMES[2]
    return SHARD_NAMES[0]


def _write_weights(out_dir: pathlib.Path) -> None:
    shapes = _vision_shapes(VISION_CONFIG, TEXT_CONFIG["hidden_size"]) | _text_shapes(TEXT_CONFIG)
    weight_map = {name: _shard_of(name) for name in sorted(shapes)}
    total_size = 0
    for shard in SHARD_NAMES:
        tensors = {n: _init_tensor(n, shapes[n]) for n, s in weight_map.items() if s == shard}
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, out_dir / shard, metadata={"format": "pt"})
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    _write_json(out_dir / "model.safetensors.index.json", index)


def write_image_chat(folder: pathlib.Path) -> pathlib.Path:
    """A JSONL file (a `kind: file` data source) of one chat showing two generated images, one by path and one as
    a data URL: the multimodal path through 01's template, 02's vision tower and 06's requests."""
    from PIL import Image

    pictures = [Image.linear_gradient("L").resize((84, 56)).convert("RGB"), Image.new("RGB", (28, 56), (0, 90, 200))]
    pictures[0].save(folder / "gradient.png")
    encoded = io.BytesIO()
    pictures[1].save(encoded, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()
    content = [{"type": "text", "text": "What differs between these two pictures?"},
               {"type": "image_url", "image_url": {"url": str(folder / "gradient.png")}},
               {"type": "image", "image": data_url}]
    chat = {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "The colour."}]}
    path = folder / "pictures.jsonl"
    path.write_text(json.dumps(chat) + "\n")
    return path
