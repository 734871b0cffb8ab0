"""The speed-up an EAGLE-3 draft predicts for Kimi-K2.5 at concurrency 1, on paper: AL·T / (T_verify + k·D).

    python -m bench.kimi_speedup            # prints the table, writes bench/results/kimi_speedup.md

At concurrency 1 a decode step is bound by the bytes of weights it reads (8x H200, tensor parallel 8: each GPU
reads an eighth of every matrix, so the ratios below do not depend on the GPU count). Counted from the published
shapes: Kimi-K2.5's text config (moonshotai/Kimi-K2.5 config.json; routed experts stored in INT4 with a bf16
scale per group of 32 weights, everything else bf16) and the reference draft's tensors
(eagle3_pipeline/reference/aq_medai_kimi_k25_eagle3.json, bf16). Three cases:

    verify = one decode step     T_verify = T, D / T = draft bytes per step / target bytes per step
    verify reads k+1 tokens'     the k+1 tokens of a verifying step route to different experts: T_verify reads
      routed experts             the dense part once and (k+1) x 8 routed experts per MoE layer (the worst case)
    launch-bound                 steps bound by kernel launches and all-reduces instead of bytes: the draft's one
                                 layer against the target's 61 (D / T = 1/61), T_verify = T

The acceptance lengths are lightseekorg/kimi-k2.5-eagle3's published ones at k = 3 (SpecForge's bench_eagle3).
"""

from __future__ import annotations

import json
import math

from bench.harness import ROOT
REFERENCE = ROOT / "eagle3_pipeline" / "reference" / "aq_medai_kimi_k25_eagle3.json"
OUT = ROOT / "bench" / "results" / "kimi_speedup.md"
K = 3
PUBLISHED_AL = {"MT-Bench": 2.69, "HumanEval": 3.29, "GSM8K": 3.20, "MATH500": 3.34}
# moonshotai/Kimi-K2.5 config.json, text_config
KIMI = {"hidden_size": 7168, "num_hidden_layers": 61, "first_k_dense_replace": 1, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840}
BF16, INT4_GROUP32 = 2.0, 0.5 + 2.0 / 32  # bytes per weight


def kimi_step_bytes(tokens: int) -> tuple[float, float]:
    """(bytes of one target decode step read once whatever the tokens, bytes of routed experts for `tokens` tokens
    that each pick their own experts)."""
    c = KIMI
    h, heads = c["hidden_size"], c["num_attention_heads"]
    attention = (h * c["q_lora_rank"] + c["q_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
                 + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"])
                 + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * h)
    expert = 3 * h * c["moe_intermediate_size"]
    moe_layers = c["num_hidden_layers"] - c["first_k_dense_replace"]
    dense = (c["num_hidden_layers"] * attention + c["first_k_dense_replace"] * 3 * h * c["intermediate_size"]
             + moe_layers * (c["n_shared_experts"] * expert + h * c["n_routed_experts"]) + c["vocab_size"] * h)
    routed = moe_layers * min(tokens * c["num_experts_per_tok"], c["n_routed_experts"]) * expert
    return dense * BF16, routed * INT4_GROUP32


def draft_step_bytes() -> float:
    """The reference draft's tensors read by one draft step: all but fc, which runs once per round on the
    target's states."""
    tensors = json.loads(REFERENCE.read_text())["tensors"]
    return sum(math.prod(t["shape"]) for name, t in tensors.items() if not name.startswith("fc.")) * BF16


def main() -> None:
    dense, routed = kimi_step_bytes(1)
    target = dense + routed
    draft = draft_step_bytes()
    _, routed_verify = kimi_step_bytes(K + 1)
    cases = {
        "verify = one decode step": (1.0, draft / target),
        f"verify reads {K + 1} tokens' routed experts": ((dense + routed_verify) / target, draft / target),
        "launch-bound (D/T = 1/61)": (1.0, 1 / KIMI["num_hidden_layers"]),
    }
    lines = [f"Kimi-K2.5 decode step: {target / 1e9:.1f} GB of weights ({dense / 1e9:.1f} GB bf16 read once, "
             f"{routed / 1e9:.1f} GB of INT4 routed experts for one token); reference draft step: "
             f"{draft / 1e9:.2f} GB (bf16, fc excluded). k = {K}.", "",
             "| case | T_verify / T | D / T | " + " | ".join(f"{name} (AL {al})" for name, al in PUBLISHED_AL.items())
             + " |", "|---|---|---|" + "---|" * len(PUBLISHED_AL)]
    for case, (verify, draft_over_target) in cases.items():
        speedups = [al / (verify + K * draft_over_target) for al in PUBLISHED_AL.values()]
        lines.append(f"| {case} | {verify:.2f} | {draft_over_target:.3f} | "
                     + " | ".join(f"{s:.2f}x" for s in speedups) + " |")
    table = "\n".join(lines) + "\n"
    OUT.write_text("# The speed-up the draft predicts for Kimi-K2.5 at concurrency 1 (bench/kimi_speedup.py)\n\n"
                   "    python -m bench.kimi_speedup\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
