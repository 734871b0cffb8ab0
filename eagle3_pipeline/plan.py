"""What a run costs before it starts: GPU-hours per stage for a config's data on H200 nodes.

    python -m eagle3_pipeline plan configs/kimi_k25.yaml --conversations 600000 --answer-tokens 1000 3000 8000

Every rate the plan uses is one `Rate` in RATES, with where it comes from: measured here on an H200 (the
Kimi-shaped benches need no scaling), taken from a named public source, or assumed (and why). The stages:
01 regenerates the answers (with the target alone or with a draft; skipped when the data is already the
target's), 02 captures every sample's states (offline once; in stream mode once per epoch), 04 trains,
06 validates. Two layouts: one node of 8 H200 running the stages in turn (02 offline), and capture nodes
plus trainer nodes running 02 and 04 at once (stream mode), 01 and 06 on one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from eagle3_pipeline.config import RunConfig

GPUS_PER_NODE = 8
DEFAULT_PROMPT_TOKENS = 1000
# conversations a benchmark source yields without a limit (data/sources.py BENCHMARKS)
BENCHMARK_CONVERSATIONS = {"humaneval": 164, "mtbench": 80, "gsm8k": 1319, "math500": 500}


class PlanError(Exception):
    """The config does not say what the plan needs and no option does either (exit code 2)."""


@dataclass(frozen=True)
class Rate:
    name: str
    value: float
    unit: str
    kind: Literal["measured here", "public source", "derived here", "assumed"]
    provenance: str


REGENERATION = Rate(
    "regeneration, target alone", 16.7 * 64, "generated tokens/s per 8xH200 node", "public source",
    "SemiAnalysis InferenceX, Kimi-K2.5 INT4 on vLLM, TP 8 on 8 H200, 8k-token prompts and 1k-token answers: "
    "16.7 tokens/s per user at concurrency 64, x 64 (tabulated at https://kimi-capacity-report.pages.dev/). Its "
    "8k prompts make it a low figure for short prompts. The 2.5-4k tokens/s per node quoted for Kimi at high "
    "concurrency was not found in a public source and is not used")
SPECULATIVE_SPEEDUP = Rate(
    "regeneration speed-up with a draft (k=3)", 1.20, "x", "derived here",
    "bench/results/kimi_speedup.md: 06's speed model, the forward 14.07 ms (Kimi-K2.5's public TPOT on 8x B200), "
    "a verifying step reading 4 tokens' routed experts and a draft step by the published shapes' bytes, "
    "sampling and the engine's time outside the step measured on an H200, at MT-Bench's AL 2.69 "
    "(lightseekorg/kimi-k2.5-eagle3's card); 2.26x if a verifying step costs one forward, 1.11x at the bytes "
    "floor. Not measured on Kimi. On the SmolLM2 stand-in, one H200, 01's "
    "concurrency 512: 26,021 -> 26,703 generated tokens/s (1.03x) at AL 2.05 (bench/results/quality_gpu.md); a 135M "
    "target is not bound by reading its weights there, so that gain says little about Kimi's")
DEEPSEEK_PREFILL = Rate(
    "DeepSeek-V3 prefill, cache hits included", 73_700, "input tokens/s per 8xH800 node", "public source",
    "DeepSeek, \"DeepSeek-V3/R1 Inference System Overview\" (github.com/deepseek-ai/open-infra-index, day 6 of "
    "its open-source week): 73.7k input tokens/s per H800 node during prefill, cache hits included")
DEEPSEEK_CACHE_HITS = Rate(
    "DeepSeek-V3 prefill tokens served from cache", 0.563, "fraction", "public source",
    "the same overview: 342B of 608B input tokens (56.3%) hit the on-disk KV cache; capture computes every token")
ACTIVE_PARAMETERS = Rate(
    "DeepSeek-V3 over Kimi-K2.5 FLOPs per token", 37 / 32, "ratio", "public source",
    "activated parameters per token from the model cards: DeepSeek-V3 37B, Kimi-K2.5 32B (the same MLA + MoE shape)")
PRECISION = Rate(
    "bf16 over FP8 matrix throughput", 989 / 1979, "ratio", "public source",
    "NVIDIA H100/H200 datasheet, dense: 989 TFLOP/s bf16, 1,979 FP8. DeepSeek's prefill multiplies in FP8; vLLM runs "
    "Kimi-K2.5's INT4 experts as bf16 products on an H200 (prefill taken as bound by its matrix products)")
HANDOVER = Rate(
    "capture hand-over, Kimi-shaped states", 0.334 + 4.882, "us per token per node", "measured here",
    "bench/results/capture_handover_h200.json, mapped bf16: 0.33 us a token left exposed behind the forward + 4.88 "
    "us a token read by 02's main process (57,344-byte Kimi states, so no scaling); all of a node's states leave "
    "through rank 0")
TRAINING = Rate(
    "04 training, Kimi draft shape", 34_586, "tokens/s per H200", "measured here",
    "bench/results/train_long_samples_h200.json: configs/kimi_k25.yaml's draft and train sections (compile, fp8, "
    "packed 16,384) with train.optimizer adamw, one H200; the draft is Kimi's, so no scaling")
MUON_STEP = Rate(
    "04 step time, Muon over AdamW, Kimi draft shape", 760.2 / 476.8, "ratio", "measured here",
    "bench/results/train_throughput_h200_muon.json: the same train section with train.optimizer adamw and muon, one "
    "H200 (476.8 and 760.2 ms a step): Muon's Newton-Schulz iterations over fc's and the decoder layer's matrices. "
    "DDP ranks split them (docs/04_train.md), which is not measured, so the plan keeps one GPU's ratio")
DDP_EFFICIENCY = Rate(
    "04 scaling efficiency over GPUs", 0.863, "fraction", "measured here",
    "bench/results/train_scaling_h200x2.json: 2 H200, Kimi draft in bf16, packed 4096; assumed to hold on 8 and more")
SINGLE_STREAM = Rate(
    "decoding one request at a time", 91.2, "tokens/s", "public source",
    "InferenceX as above, 16.7 -> 91.2 tokens/s per user at concurrency 4: 06's one-at-a-time latency prompts")
ENGINE_START = Rate(
    "Kimi-K2.5 engine start", 600, "s", "assumed",
    "neither measured here nor found published: 554 GB of weights over 8 ranks plus CUDA-graph capture")

RATES = (REGENERATION, SPECULATIVE_SPEEDUP, DEEPSEEK_PREFILL, DEEPSEEK_CACHE_HITS, ACTIVE_PARAMETERS, PRECISION,
         HANDOVER, TRAINING, MUON_STEP, DDP_EFFICIENCY, SINGLE_STREAM, ENGINE_START)


def prefill_tokens_per_s() -> float:
    """Kimi-K2.5's prefill per 8xH200 node: DeepSeek's computed prefill tokens scaled by FLOPs and precision."""
    computed = DEEPSEEK_PREFILL.value * (1 - DEEPSEEK_CACHE_HITS.value)
    return computed * ACTIVE_PARAMETERS.value * PRECISION.value


def capture_tokens_per_s() -> float:
    """02 on one node: the prefill plus the hand-over of its states, one after the other."""
    return 1 / (1 / prefill_tokens_per_s() + HANDOVER.value * 1e-6)


def training_tokens_per_s(gpus: int, optimizer: str) -> float:
    """04 at the Kimi draft's shape with `train.optimizer`: a Muon step takes MUON_STEP times an AdamW one."""
    per_gpu = TRAINING.value / (MUON_STEP.value if optimizer == "muon" else 1.0)
    return per_gpu * gpus * (DDP_EFFICIENCY.value if gpus > 1 else 1.0)


@dataclass(frozen=True)
class Data:
    conversations: int
    prompt_tokens: int
    answer_tokens: int  # generated per conversation
    sample_tokens: int  # captured and trained per conversation (data.max_seq_len caps it)
    regenerates: bool


def conversations_of(config: RunConfig, path: str, conversations: int | None) -> int:
    """--conversations, else the sum of the training sources' sizes; a source of unknown size is an error."""
    if conversations is not None:
        return conversations
    total = 0
    for i, source in enumerate(config.data.sources):
        if source.limit is None and source.kind not in BENCHMARK_CONVERSATIONS:
            raise PlanError(f"{path}: data.sources[{i}] ({source.kind} {source.name}) has no limit, so its size "
                            f"is unknown: pass --conversations N")
        total += source.limit or BENCHMARK_CONVERSATIONS[source.kind]
    return total


def plan_data(config: RunConfig, path: str, conversations: int | None, answer_tokens: int | None,
              prompt_tokens: int) -> Data:
    regenerate = config.data.regenerate
    answer = answer_tokens or regenerate.max_tokens
    if regenerate.enabled:
        answer = min(answer, regenerate.max_tokens)
    return Data(conversations_of(config, path, conversations), prompt_tokens, answer,
                min(prompt_tokens + answer, config.data.max_seq_len), regenerate.enabled)


def stage_gpu_hours(config: RunConfig, data: Data) -> dict[str, float | None]:
    """GPU-hours of each stage's work on H200s (None: the stage has nothing to do)."""
    node_hours = GPUS_PER_NODE / 3600
    generated = data.conversations * data.answer_tokens
    sample_tokens = data.conversations * data.sample_tokens
    regeneration = generated / REGENERATION.value * node_hours if data.regenerates else None
    capture = sample_tokens / capture_tokens_per_s() * node_hours
    return {
        "01 regeneration, target alone": regeneration,
        "01 regeneration, with a draft": None if regeneration is None else regeneration / SPECULATIVE_SPEEDUP.value,
        "02 capture, offline (once)": capture,
        "02 capture, stream (per epoch)": capture,
        "04 training (per epoch)": sample_tokens / training_tokens_per_s(GPUS_PER_NODE, config.train.optimizer)
        * node_hours,
        "06 validation": validation_seconds(config) * node_hours,
    }


def validation_seconds(config: RunConfig) -> float:
    """06 on one node: one engine per k (plus one without the draft), each running the eval prompts batched and
    the latency prompts in groups of each latency concurrency (a group decodes at about one stream's pace)."""
    validate = config.validate_
    engines = len(validate.num_speculative_tokens) + validate.compare_without_speculation
    prompts = validate.max_prompts or sum(s.limit or BENCHMARK_CONVERSATIONS.get(s.kind, 0)
                                          for s in config.data.eval_sources)
    batched = prompts * validate.max_tokens / REGENERATION.value
    groups = sum(-(-max(validate.latency_prompts, c) // c) for c in validate.latency_concurrency) \
        if validate.latency_prompts else 0
    grouped = groups * validate.max_tokens / SINGLE_STREAM.value
    return engines * (ENGINE_START.value + batched + grouped)


def split_layout(capture_nodes: int | None, trainer_nodes: int, optimizer: str) -> tuple[int, int]:
    """(capture nodes, trainer nodes); by default as many capture nodes as keep the trainer nodes busy."""
    if capture_nodes is None:
        trainer_rate = training_tokens_per_s(trainer_nodes * GPUS_PER_NODE, optimizer)
        capture_nodes = max(1, round(trainer_rate / capture_tokens_per_s()))
    return capture_nodes, trainer_nodes


def layout_totals(stages: dict[str, float | None], regeneration: str | None,
                  split: tuple[int, int] | None) -> tuple[float, float]:
    """(GPU-hours, wall hours) of one epoch: 01 as `regeneration` says (a stage name, None: skipped) and 06 on one
    node; 02 and 04 in turn on that node (split None) or at once on capture and trainer nodes (stream mode), where
    every GPU of the pair is held until the slower side ends."""
    one_node = (stages[regeneration] if regeneration else 0.0) + stages["06 validation"]
    if split is None:
        gpu_hours = one_node + stages["02 capture, offline (once)"] + stages["04 training (per epoch)"]
        return gpu_hours, gpu_hours / GPUS_PER_NODE
    capture_nodes, trainer_nodes = split
    stream_wall = max(stages["02 capture, stream (per epoch)"] / (capture_nodes * GPUS_PER_NODE),
                      stages["04 training (per epoch)"] / (trainer_nodes * GPUS_PER_NODE))
    return (one_node + stream_wall * (capture_nodes + trainer_nodes) * GPUS_PER_NODE,
            one_node / GPUS_PER_NODE + stream_wall)


def hours(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def render(config: RunConfig, path: str, conversations: int | None = None, answer_tokens: list[int] | None = None,
           prompt_tokens: int | None = None, capture_nodes: int | None = None, trainer_nodes: int = 1) -> str:
    """The plan as markdown: the data, GPU-hours per stage, totals per layout, the dominant term, the rates."""
    regenerate = config.data.regenerate
    runs = [plan_data(config, path, conversations, answer, prompt_tokens or DEFAULT_PROMPT_TOKENS)
            for answer in answer_tokens or [None]]
    stages = [stage_gpu_hours(config, data) for data in runs]
    split = split_layout(capture_nodes, trainer_nodes, config.train.optimizer)
    first = runs[0]
    counted = "--conversations" if conversations is not None else "the sum of data.sources' sizes"
    prompts = "--prompt-tokens" if prompt_tokens else "assumed: the config does not say; pass --prompt-tokens"
    answers = ("--answer-tokens" if answer_tokens else "data.regenerate.max_tokens, the longest an answer may be")
    if regenerate.enabled:
        answers += f"; at most data.regenerate.max_tokens = {regenerate.max_tokens:,}"
    lines = [f"Plan for {path}: {first.conversations:,} conversations ({counted}), prompts of {first.prompt_tokens:,} "
             f"tokens ({prompts}), answers of {' / '.join(f'{d.answer_tokens:,}' for d in runs)} tokens ({answers}); "
             f"a sample is at most data.max_seq_len = {config.data.max_seq_len:,} tokens. One epoch; GPU-hours on "
             "H200s at Kimi-K2.5's rates (below), whatever the config's target.", "",
             "| stage | " + " | ".join(f"{d.answer_tokens:,}-token answers" for d in runs) + " |",
             "|---|" + "---|" * len(runs),
             "| tokens generated / captured and trained | "
             + " | ".join(f"{d.conversations * d.answer_tokens / 1e9:.2f} B / {d.conversations * d.sample_tokens / 1e9:.2f} B"
                          for d in runs) + " |"]
    for name in stages[0]:
        cells = [hours(s[name]) if s[name] is not None else "skipped (data.regenerate.enabled: false)" for s in stages]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    cases = ({"regenerated by the target alone": "01 regeneration, target alone",
              "regenerated with a draft (k=3)": "01 regeneration, with a draft",
              "already the target's (e.g. kimi-mtp-dataset, schema kimi_mtp): 01 skips it": None}
             if regenerate.enabled else {"the sources' answers (data.regenerate.enabled: false)": None})
    layouts = {f"one node of {GPUS_PER_NODE} H200: 01, 02 offline, 04, 06 in turn": None,
               f"{split[0]} capture nodes + {split[1]} trainer node{'s' * (split[1] > 1)} of {GPUS_PER_NODE} H200: "
               "02 and 04 at once "
               "(capture.mode stream), 01 and 06 on one node": split}
    lines += ["", "Total GPU-hours (wall-clock hours) of one epoch:", "",
              "| layout | data | " + " | ".join(f"{d.answer_tokens:,}-token answers" for d in runs) + " |",
              "|---|---|" + "---|" * len(runs)]
    for layout, nodes in layouts.items():
        for case, regeneration in cases.items():
            totals = [layout_totals(s, regeneration, nodes) for s in stages]
            lines.append(f"| {layout} | {case} | "
                         + " | ".join(f"{hours(gpu)} ({hours(wall)})" for gpu, wall in totals) + " |")

    train = config.train
    rows = train.max_steps * GPUS_PER_NODE * train.micro_batch_size * train.grad_accumulation * train.packed_length
    lines += ["", f"04's train.max_steps ({train.max_steps:,} steps of {GPUS_PER_NODE} GPUs x "
              f"{train.micro_batch_size * train.grad_accumulation} packs of {train.packed_length:,} rows, "
              f"{rows / 1e9:.2f} B rows) is " + " / ".join(f"{rows / (d.conversations * d.sample_tokens):.1f}"
                                                         for d in runs)
              + " epochs of this data: 02 in stream mode captures each epoch again."]
    configured = ("01 regeneration, with a draft" if regenerate.speculative else "01 regeneration, target alone"
                  ) if regenerate.enabled else None
    lines += ["", "Dominant term (one node, the config's own data path): " + "; ".join(
        f"{d.answer_tokens:,}-token answers: {dominant(s, configured)}" for s, d in zip(stages, runs)) + ".", ""]
    lines += rates_table(train.optimizer)
    return "\n".join(lines) + "\n"


def dominant(stages: dict[str, float | None], regeneration: str | None) -> str:
    """The largest stage of the one-node total, and its share of it."""
    parts = {name: stages[name] for name in (regeneration, "02 capture, offline (once)", "04 training (per epoch)",
                                               "06 validation") if name}
    total, _ = layout_totals(stages, regeneration, None)
    name = max(parts, key=parts.get)
    return f"{name} ({parts[name] / total:.0%})"


def rates_table(optimizer: str) -> list[str]:
    lines = ["| rate | value | unit | kind | where it comes from |", "|---|---|---|---|---|"]
    lines += [f"| {r.name} | {r.value:,.0f} | {r.unit} | {r.kind} | {r.provenance} |" if r.value >= 100 else
              f"| {r.name} | {r.value:.4g} | {r.unit} | {r.kind} | {r.provenance} |" for r in RATES]
    lines.append(f"| Kimi-K2.5 prefill | {prefill_tokens_per_s():,.0f} | tokens/s per 8xH200 node | derived here | "
                 f"{DEEPSEEK_PREFILL.value:,.0f} x (1 - {DEEPSEEK_CACHE_HITS.value}) x 37/32 x 989/1979 |")
    lines.append(f"| 02 capture | {capture_tokens_per_s():,.0f} | tokens/s per 8xH200 node | derived here | "
                 f"1 / (1 / prefill + {HANDOVER.value:.2f} us): the hand-over follows the prefill |")
    muon = f" / {MUON_STEP.value:.4g} (train.optimizer muon)" if optimizer == "muon" else ""
    lines.append(f"| 04 training | {training_tokens_per_s(GPUS_PER_NODE, optimizer):,.0f} | tokens/s per 8xH200 node | "
                 f"derived here | {TRAINING.value:,.0f} x 8 x {DDP_EFFICIENCY.value}{muon} |")
    return lines
