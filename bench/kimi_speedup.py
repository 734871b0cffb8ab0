"""The speed-up the reference draft predicts for Kimi-K2.5 at concurrency 1: 06's model (validate/speed.py) with
the forwards counted from the published shapes' bytes and the host's parts measured on a GPU.

    python -m bench.kimi_speedup --reports bench/results/speed_model_h200_report_{1,2,3,4}.json \
        --out bench/results/kimi_speedup

The cycle is verify forward + k·D + sampling and rejection + the time outside the worker's step; a decode step
without the draft is the target's forward + its sampling + the same outside. Its inputs, each with its source:

- the target's forward T_f: unknown on our machines, so a sweep: the bytes floor (each of 8 H200s reads an eighth
  of a step's weights at 4.8 TB/s, nothing else), and the 14.07 ms TPOT p50 without speculation published for
  Kimi-K2.5 on 8x B200 (modularai/Kimi-K2.5-MTP's card; taken as T_f, its host parts inside it);
- the verifying forward: T_f, or T_f x the bytes of a step whose k+1 tokens each read their own 8 routed experts
  (the MoE caveat), counted from Kimi-K2.5's text config (routed experts INT4 with a bf16 scale per 32 weights,
  everything else bf16);
- a draft step D: T_f x the reference draft's bytes per step over the target's (all of
  eagle3_pipeline/reference/aq_medai_kimi_k25_eagle3.json's tensors but fc, which runs once a round), and no
  less than the draft step measured in the reports (a one-layer draft's launches);
- sampling and rejection with the draft, sampling without it and the time outside the worker's step: the reports'
  own, at concurrency 1 (SmolLM2 on the GPU they ran on; host work, so not scaled, but the vocab differs: 49,152
  against Kimi's 163,840);
- the acceptance lengths: lightseekorg/kimi-k2.5-eagle3's published ones at k = 3 (SpecForge's bench_eagle3).

Long outputs: each request's fixed time (prefill, the draft's first round) is left out.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from bench.harness import ROOT, parser, save
from bench.speed_model import current_model, reports_in
from eagle3_pipeline.validate.speed import StepCosts, predicted_speedup

REFERENCE = ROOT / "eagle3_pipeline" / "reference" / "aq_medai_kimi_k25_eagle3.json"
K = 3
PUBLISHED_AL = {"MT-Bench": 2.69, "HumanEval": 3.29, "GSM8K": 3.20, "MATH500": 3.34}
# moonshotai/Kimi-K2.5 config.json, text_config
KIMI = {"hidden_size": 7168, "num_hidden_layers": 61, "first_k_dense_replace": 1, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "n_routed_experts": 384, "num_experts_per_tok": 8, "n_shared_experts": 1,
        "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840}
BF16, INT4_GROUP32 = 2.0, 0.5 + 2.0 / 32  # bytes per weight
H200_BYTES_PER_S, GPUS = 4.8e12, 8
B200_TPOT_MS = 14.07  # modularai/Kimi-K2.5-MTP's card: 8x B200, no speculation, TPOT p50


def kimi_step_bytes(tokens: int) -> tuple[float, float]:
    """(bytes of one target step read once whatever the tokens, bytes of routed experts for `tokens` tokens that
    each pick their own experts)."""
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
    """The reference draft's weights read by one draft step: its bf16 tensors but fc, which runs once per round
    (d2t and t2d are index maps)."""
    tensors = json.loads(REFERENCE.read_text())["tensors"]
    return sum(math.prod(t["shape"]) for name, t in tensors.items()
               if t["dtype"] == "bfloat16" and not name.startswith("fc.")) * BF16


def host_parts(paths: list[Path]) -> dict[str, float]:
    """The reports' means at concurrency 1, in ms: sampling and rejection with the draft, sampling without it, the
    time outside the worker's step (06's current model) and the draft step."""
    phases = [(report, run["speed"]["by_concurrency"]["1"]) for path in paths for _, report in reports_in(path)
              for run in report["runs"]]
    if not phases:
        raise ValueError("no 06 report with a phase at concurrency 1 in " + " ".join(map(str, paths)))
    return {"sample_ms": statistics.fmean(figures["sample_ms"] for _, figures in phases),
            "plain_sample_ms": statistics.fmean(figures["plain_worker_mean_ms"]["sample_tokens"]
                                                for _, figures in phases),
            "outside_ms": statistics.fmean(current_model(report, "1", figures)["outside_step_ms"]
                                           for report, figures in phases),
            "draft_step_floor_ms": statistics.fmean(figures["draft_step_ms"] for _, figures in phases)}


def speedup(forward_ms: float, verify_over_forward: float, draft_over_target: float, host: dict,
            acceptance_length: float) -> float:
    """06's model at one request, long outputs: a decode step per token without the draft, a cycle per AL."""
    costs = StepCosts(verify_forward=forward_ms * verify_over_forward,
                      draft_step=max(forward_ms * draft_over_target, host["draft_step_floor_ms"]),
                      sample=host["sample_ms"], outside=host["outside_ms"])
    target_step = forward_ms + host["plain_sample_ms"] + host["outside_ms"]
    return predicted_speedup(costs, K, target_step, 0.0, 0.0, [1.0], [1 / acceptance_length])


def table(host: dict) -> dict:
    """Per forward time and verify case, the predicted speed-up at each published acceptance length."""
    dense, routed = kimi_step_bytes(1)
    _, routed_verify = kimi_step_bytes(K + 1)
    target = dense + routed
    forwards = {"bytes floor, 8x H200": target / GPUS / H200_BYTES_PER_S * 1e3,
                "public TPOT, 8x B200": B200_TPOT_MS}
    verify_cases = {"verify = one forward": 1.0,
                    f"verify reads {K + 1} tokens' routed experts": (dense + routed_verify) / target}
    rows = [{"forward": name, "forward_ms": forward_ms, "verify": case, "verify_over_forward": ratio,
             "speedup": {bench: speedup(forward_ms, ratio, draft_step_bytes() / target, host, al)
                         for bench, al in PUBLISHED_AL.items()}}
            for name, forward_ms in forwards.items() for case, ratio in verify_cases.items()]
    return {"target_gb": target / 1e9, "draft_gb": draft_step_bytes() / 1e9, "host_ms": host, "rows": rows}


def markdown(result: dict) -> str:
    host = result["host_ms"]
    lines = ["# The speed-up the reference draft predicts for Kimi-K2.5 at concurrency 1 (bench/kimi_speedup.py)",
             "", "    " + result["command"], "",
             f"A Kimi-K2.5 step reads {result['target_gb']:.1f} GB of weights, a draft step {result['draft_gb']:.2f}"
             f" GB. Host parts from the reports (ms): sampling and rejection {host['sample_ms']:.2f}, sampling "
             f"without the draft {host['plain_sample_ms']:.2f}, outside the worker's step {host['outside_ms']:.2f},"
             f" draft step floor {host['draft_step_floor_ms']:.2f}. k = {K}.", "",
             "| forward | T_f ms | verify | " + " | ".join(f"{name} (AL {al})" for name, al in PUBLISHED_AL.items())
             + " |", "|---|---|---|" + "---|" * len(PUBLISHED_AL)]
    for row in result["rows"]:
        lines.append(f"| {row['forward']} | {row['forward_ms']:.2f} | {row['verify']} ({row['verify_over_forward']:.2f}"
                     " T_f) | " + " | ".join(f"{value:.2f}x" for value in row["speedup"].values()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--reports", type=Path, nargs="+", required=True, help="06 report.json files from a GPU")
    cli.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = cli.parse_args()
    try:
        host = host_parts(args.reports)
    except (OSError, KeyError, ValueError) as err:
        cli.error(f"{err.__class__.__name__}: {err}" if isinstance(err, KeyError) else str(err))
    result = {"command": "python -m bench.kimi_speedup --reports " + " ".join(map(str, args.reports))
              + f" --out {args.out}"} | table(host)
    save(args.out.with_suffix(".json"), result)
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
