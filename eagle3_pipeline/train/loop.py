"""Stage 04: train the draft on the captured hidden states with training-time test; `run` reads top to bottom.

Reads 01_data (token ids, loss masks), 02_hidden_states (aux and final states; with capture.mode stream, the
train split's come through 02's stream while 02 runs: stream.py), 03_vocab (d2t, t2d) (all three: inputs.py)
and three tensors of the target checkpoint (verifier.py). Writes 04_train/: checkpoints/step_N/ (checkpoint.py),
metrics.jsonl, tensorboard/, curves.png (metrics.py), and manifest.json, whose counts hold the final eval
accuracy per TTT step (`eval_accuracy`, a list; stage 06 compares vLLM's acceptance with its first entry).

One process per device under `accelerate launch` (or torchrun on CPU); every process runs this same code.
"""

from __future__ import annotations

import time

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedDataParallelKwargs, FullyShardedDataParallelPlugin, set_seed
from tqdm import tqdm

from eagle3_pipeline.acceptance import AcceptanceCounts
from eagle3_pipeline.config import ConfigError, RunConfig
from eagle3_pipeline.stage_io import Stage, StageError
from eagle3_pipeline.target import target_path
from eagle3_pipeline.train.acceptance import chain_metrics, is_served, replay_batch, target_proposals
from eagle3_pipeline.train.attention import resolve_attention
from eagle3_pipeline.train.checkpoint import adopt_split, load_checkpoint, save_checkpoint, step_dirs
from eagle3_pipeline.train.data import PackedRows, RankPacks, rank_share
from eagle3_pipeline.train.draft_model import (
    STATS,
    accelerate_draft,
    build_draft,
    load_frozen_and_vocab,
    standardize_aux,
)
from eagle3_pipeline.train.flops import attended_keys, peak_flops, train_flops
from eagle3_pipeline.train.inputs import Inputs, read_inputs, wait_for_states
from eagle3_pipeline.train.loss import LOSSES
from eagle3_pipeline.train.metrics import MetricsLog, eval_summary, summarize, trained_loss_key
from eagle3_pipeline.train.step import lr_schedule, make_optimizer, to_device, train_step
from eagle3_pipeline.train.verifier import load_verifier_weights


def run(config: RunConfig, resume: bool = False, force: bool = False, stop_at_step: int | None = None) -> None:
    """Stage 04: train the draft on 02's states (`resume`: from the last checkpoint; `stop_at_step`: checkpoint
    and stop there, unfinished)."""
    train = config.train
    accelerator = make_accelerator(train)
    stage = Stage(config, "04_train", force=force)
    if stage.is_complete():
        return
    packs_per_step = accelerator.num_processes * train.micro_batch_size * train.grad_accumulation
    wait_for_states(config)
    stage.check_inputs()
    inputs = read_inputs(stage, config)  # before begin(): a config it refuses leaves nothing to --force
    begin(stage, accelerator, resume, packs_per_step)
    set_seed(train.seed)  # identical initial weights on every process

    model = build_model(config, inputs, resolve_attention_or_fail(train.attention, accelerator.device))
    accelerate_draft(model, train, accelerator.device)  # fp8, fused loss, compiled unroll (as configured)
    optimizer = make_optimizer(model.to(accelerator.device), train)
    scheduler = lr_schedule(optimizer, train)
    model, optimizer = accelerator.prepare(model, optimizer)
    start_step = restore(stage, resume, model, optimizer, scheduler, accelerator, packs_per_step)
    if stop_at_step is not None and not start_step < stop_at_step <= train.max_steps:
        raise StageError(f"--stop-at-step {stop_at_step}: must lie after step {start_step} (where this launch "
                         f"starts) and at most train.max_steps {train.max_steps}")
    train_batches = iter(train_loader(inputs, train, start_step, accelerator))
    describe(config, inputs, model, accelerator, packs_per_step, start_step)
    end = train.max_steps * packs_per_step
    if accelerator.is_main_process:  # streaming, this also rewinds the capture jobs after a resume
        inputs.feed.advance(start_step * packs_per_step, end, packs_per_step, start_step)

    log = MetricsLog(stage.dir, start_step, accelerator.is_main_process)
    meter = Throughput(config, inputs.num_aux, accelerator)
    step_weights = train.ttt_step_weights or [1.0] * train.ttt_steps
    float_dtype = torch.bfloat16 if train.mixed_precision == "bf16" else torch.float32
    progress = tqdm(total=train.max_steps, initial=start_step, disable=not accelerator.is_main_process,
                    desc="04_train", dynamic_ncols=True)
    eval_values = None
    for step in range(start_step + 1, train.max_steps + 1):  # step = optimizer steps done after this one
        try:
            packs = meter.wait_for(lambda: [next(train_batches) for _ in range(train.grad_accumulation)])
        except StageError as err:
            raise stopped_by_data(err, stage, step - 1, start_step, model, optimizer, scheduler, accelerator,
                                 packs_per_step, train) from None
        meter.count(packs)  # on the host copies: no device synchronisation
        log.log_batch(step, batch_record(inputs, step, packs_per_step))
        micro_batches = [to_device(batch, accelerator.device, float_dtype) for batch in packs]
        if step == 1 and train.standardize_aux:  # a resumed run has its scales from the checkpoint
            standardize_aux(accelerator.unwrap_model(model), micro_batches, accelerator)
        stats, grad_norm = train_step(model, optimizer, scheduler, micro_batches, accelerator,
                                      train.ttt_steps, step_weights, train.grad_clip)
        meter.add(stats)
        if accelerator.is_main_process:  # every rank has its packs of this step in memory
            inputs.feed.advance(step * packs_per_step, end, packs_per_step, step)
        progress.update()
        if step % train.log_every == 0 or step == train.max_steps:
            values = meter.report(lr=scheduler.get_last_lr()[0], grad_norm=float(grad_norm))
            log.log(step, "train", values)
            progress.set_postfix({train.loss: f"{values[trained_loss_key(train.loss, 0)]:.3f}",
                                  "acc0": f"{values['acc_0']:.3f}", "tok_s": f"{values['tokens_per_s']:.0f}"})
        if inputs.eval_rows is not None and (step % train.eval_every == 0 or step == train.max_steps):
            eval_values = evaluate(model, inputs, config, accelerator, step_weights, float_dtype)
            log.log(step, "eval", eval_values)
        if step % train.checkpoint_every == 0 or step in (train.max_steps, stop_at_step):
            checkpoint(stage, step, model, optimizer, scheduler, accelerator, packs_per_step, train)
        if step == stop_at_step and step < train.max_steps:
            progress.close()
            log.close()
            print(f"04_train: stopped at step {step} (--stop-at-step); rerun with --resume to continue")
            return
    progress.close()
    if eval_values is None and inputs.eval_rows is not None:  # resumed at the last step: nothing was left
        eval_values = evaluate(model, inputs, config, accelerator, step_weights, float_dtype)

    log.plot(stage.path("curves.png"), train.ttt_steps)
    log.close()
    if accelerator.is_main_process:
        inputs.feed.finish(end, packs_per_step, train.max_steps)
        stage.finish(counts=final_counts(eval_values, meter, train), extra={
            "final_checkpoint": f"checkpoints/step_{train.max_steps}",
            "aux_layer_ids": inputs.layout.aux_layer_ids,
        })
    accelerator.wait_for_everyone()


# ------------------------------------------------------------------------------------------------- setup
def make_accelerator(train) -> Accelerator:
    """DDP (or FSDP) over the launched processes; bf16 autocast over fp32 master weights when asked."""
    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True) \
        if train.distributed == "fsdp" else None
    # accelerate keeps one process-wide state that refuses another precision: a second run in this process resets it
    if AcceleratorState._shared_state.get("_mixed_precision", train.mixed_precision) != train.mixed_precision:
        AcceleratorState._reset_state(reset_partial_state=False)
    return Accelerator(
        cpu=not torch.cuda.is_available(),
        mixed_precision=train.mixed_precision,
        fsdp_plugin=fsdp,
        # d2t/t2d never change: skip DDP's per-forward buffer broadcast (it would also deadlock
        # evaluation when processes run different numbers of batches)
        kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)],
    )


def begin(stage: Stage, accelerator: Accelerator, resume: bool, packs_per_step: int) -> None:
    """The main process prepares the folder (or keeps partial work, also when --resume splits the same global
    batch over another number of processes: checkpoint.adopt_split); the others wait for it."""
    if accelerator.is_main_process:
        if resume and not stage.force:
            adopt_split(stage, packs_per_step)
        stage.begin()
    accelerator.wait_for_everyone()


def resolve_attention_or_fail(choice: str, device: torch.device) -> str:
    if choice == "flex" and device.type != "cuda":
        raise ConfigError("train.attention: flex needs a GPU (it has no CPU backward); use auto or sdpa")
    return resolve_attention(choice, device)


def build_model(config: RunConfig, inputs: Inputs, attention: str):
    """The draft, with the target's three tensors read into it (and not kept beyond)."""
    verifier = load_verifier_weights(target_path(config.target), config.target.weight_prefix)
    if verifier.embed_tokens.shape[0] != inputs.t2d.numel():
        raise StageError(f"03_vocab maps a vocabulary of {inputs.t2d.numel()} tokens, the target has "
                         f"{verifier.embed_tokens.shape[0]}: rerun 03_build_vocab_map.py --force")
    model = build_draft(config.draft, inputs.layout.aux_layer_ids, inputs.t2d.numel(), attention,
                        standardize_aux=config.train.standardize_aux)
    load_frozen_and_vocab(model, verifier, inputs.d2t, inputs.t2d, train_lm_head=not config.train.freeze_lm_head)
    return model


def restore(stage, resume: bool, model, optimizer, scheduler, accelerator, packs_per_step: int) -> int:
    """The step to start from: 0, or the last checkpoint's when resuming."""
    found = step_dirs(stage.path("checkpoints"))
    if found and not resume:
        raise StageError(f"{stage.dir} holds checkpoints up to {found[-1].name} of an unfinished run: "
                         "add --resume to continue it, or --force to start over")
    if not found:
        if resume:
            print("04_train: no checkpoint to resume from; starting at step 0")
        return 0
    step = load_checkpoint(found[-1], model, optimizer, scheduler, accelerator, packs_per_step)
    print(f"04_train: resumed from {found[-1]} (model, optimizer, schedule, RNG, data position)")
    return step


def train_loader(inputs: Inputs, train, start_step: int, accelerator) -> torch.utils.data.DataLoader:
    packs_per_rank = train.micro_batch_size * train.grad_accumulation
    sampler = RankPacks(inputs.train_stream, start_step, train.max_steps, accelerator.process_index,
                        accelerator.num_processes, packs_per_rank)
    return _loader(inputs.train_rows, sampler, train, accelerator)


def _loader(rows: PackedRows, sampler, train, accelerator) -> torch.utils.data.DataLoader:
    workers = train.num_workers
    return torch.utils.data.DataLoader(
        rows, sampler=sampler, batch_size=train.micro_batch_size, num_workers=workers,
        pin_memory=accelerator.device.type == "cuda", prefetch_factor=4 if workers else None,
    )


def describe(config: RunConfig, inputs: Inputs, model, accelerator, packs_per_step: int, start_step: int) -> None:
    """Print the derived figures before the first step (nanoGPT style)."""
    if not accelerator.is_main_process:
        return
    train, stream = config.train, inputs.train_stream
    epoch_packs = len(stream.epoch(0))
    rows = int(stream.rows_per_sample.sum())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    per_token = train_flops(config.draft, inputs.num_aux, train.ttt_steps, 1, 0, not train.freeze_lm_head)
    print(f"04_train: {len(stream.rows_per_sample)} train samples, {rows} rows, {epoch_packs} packs of "
          f"{train.packed_length} ({rows / (epoch_packs * train.packed_length):.1%} filled); "
          f"{len(inputs.eval_packs)} eval packs")
    mode = f" ({accelerator.distributed_type.value})" if accelerator.num_processes > 1 else ""
    print(f"04_train: {accelerator.num_processes} process(es) on {accelerator.device.type}{mode}, global batch "
          f"{packs_per_step} packs ({packs_per_step * train.packed_length} rows) per step; {train.max_steps} steps "
          f"= {train.max_steps * packs_per_step / epoch_packs:.2f} epochs; starting at step {start_step}")
    if inputs.simulated_ks:
        print(f"04_train: eval simulates vLLM's acceptance at k = {inputs.simulated_ks} on "
              f"{sum(map(is_served, inputs.eval_samples))} served turns, up to "
              f"validate.max_tokens {config.validate_.max_tokens} tokens each")
    elif inputs.eval_rows is not None:
        print("04_train: eval does not simulate acceptance: the eval answers are not the target's greedy ones "
              "(data.regenerate enabled at eval_temperature 0 makes them so)")
    eta = f", lk_eta {train.lk_eta}" if train.loss == "lk" else ""
    recorded = "" if train.loss == "kl" else f"; recorded as {train.loss}_<k>, loss_<k> stays the forward KL"
    print(f"04_train: loss {train.loss} = {LOSSES[train.loss]} per counted row{eta}{recorded}")
    print(f"04_train: draft {trainable / 1e6:.1f} M trainable + {frozen / 1e6:.1f} M frozen parameters, "
          f"{per_token / 1e9:.2f} GFLOP per token at {train.ttt_steps} TTT steps (+ attention), "
          f"precision {train.mixed_precision}")


# ------------------------------------------------------------------------------------------- during the loop
def batch_record(inputs: Inputs, step: int, packs_per_step: int) -> list[dict]:
    """The packs of a step's global batch as (position, epoch, sample ids), for metrics.jsonl."""
    record = []
    for position in range((step - 1) * packs_per_step, step * packs_per_step):
        epoch, _ = inputs.train_stream.locate(position)
        ids = list(inputs.train_rows.dataset.select(inputs.train_stream.pack(position))["id"])
        record.append({"position": position, "epoch": epoch, "samples": ids})
    return record


def stopped_by_data(err: StageError, stage: Stage, done_step: int, start_step: int, model, optimizer, scheduler,
                   accelerator, packs_per_step: int, train) -> StageError:
    """A data error (a corrupt stream item, the stream timed out), as one line; a timed-out stream leaves a
    checkpoint of the last step done, so `--resume` loses nothing."""
    message = str(err).strip().splitlines()[-1]  # a data loader worker wraps it in its traceback
    message = message.removeprefix(f"{type(err).__module__}.{type(err).__name__}: ")
    if err.leaves_checkpoint:
        if done_step > start_step:
            checkpoint(stage, done_step, model, optimizer, scheduler, accelerator, packs_per_step, train)
        message += f" (checkpoint: step {done_step})"
    return StageError(message)


def checkpoint(stage: Stage, step: int, model, optimizer, scheduler, accelerator, packs_per_step: int, train) -> None:
    save_checkpoint(stage.path("checkpoints"), step, model, optimizer, scheduler, accelerator, packs_per_step,
                    train.keep_checkpoints, split={"processes": accelerator.num_processes,
                                                   "micro_batch_size": train.micro_batch_size,
                                                   "grad_accumulation": train.grad_accumulation})


# ----------------------------------------------------------------------------------------- measurement
class Throughput:
    """Per-step statistics and tokens between two log points, summed over processes when reported."""

    def __init__(self, config: RunConfig, num_aux: int, accelerator):
        self.config, self.num_aux, self.accelerator = config, num_aux, accelerator
        self.peak = peak_flops(accelerator.device)
        self.total_tokens = 0
        self._reset()

    def _reset(self) -> None:
        self.stats, self.tokens, self.keys, self.since = 0, 0, 0, time.perf_counter()
        self.data_wait = 0.0

    def wait_for(self, read_batches):
        """The batches `read_batches()` returns, timing how long the step waited for its data."""
        started = time.perf_counter()
        batches = read_batches()
        self.data_wait += time.perf_counter() - started
        return batches

    def count(self, batches: list[dict]) -> None:
        for batch in batches:
            self.tokens += int((batch["document_ids"] >= 0).sum())
            self.keys += attended_keys(batch["document_ids"], self.config.train.ttt_steps)

    def add(self, stats: torch.Tensor) -> None:
        self.stats = self.stats + stats

    def report(self, **extra: float) -> dict[str, float]:
        reduce = self.accelerator.reduce
        stats = reduce(self.stats, "sum")
        counts = reduce(torch.tensor([self.tokens, self.keys], dtype=torch.float64, device=stats.device), "sum")
        seconds = time.perf_counter() - self.since
        tokens, keys = int(counts[0]), int(counts[1])
        self.total_tokens += tokens
        values = {**summarize(stats, self.config.train.loss), **extra, "tokens_per_s": tokens / seconds,
                  "data_wait_frac": self.data_wait / seconds,  # of the main process; 1.0 = training starved
                  "interval_s": seconds}  # since the last log point: weights the fractions into a run's share
        if self.peak:
            flops = train_flops(self.config.draft, self.num_aux, self.config.train.ttt_steps, tokens, keys,
                                not self.config.train.freeze_lm_head)
            values["mfu"] = flops / seconds / (self.peak * self.accelerator.num_processes)
        self._reset()
        return values


@torch.no_grad()
def evaluate(model, inputs: Inputs, config: RunConfig, accelerator, step_weights,
             float_dtype) -> dict[str, float]:
    """Loss and accuracy per TTT step over the whole eval split (each process a share), and the acceptance
    vLLM would measure, simulated at each k of `inputs.simulated_ks` (acceptance.py): `al_k<k>` and
    `al_k<k>_pos<i>` over all served turns, the same with `/<eval source>` appended per source."""
    train, ks = config.train, inputs.simulated_ks
    steps = max([train.ttt_steps, *ks])  # a k past the trained steps unrolls the chain further, loss-free
    weights = [*step_weights, *[0.0] * (steps - train.ttt_steps)]
    packs = rank_share(inputs.eval_packs, accelerator.process_index, accelerator.num_processes)
    sources = sorted({sample["source"] for sample in inputs.eval_samples})
    chains = {(source, k): AcceptanceCounts(k) for source in sources for k in ks}
    d2t = accelerator.unwrap_model(model).d2t
    stats = torch.zeros(len(STATS), steps, device=accelerator.device)
    for index, batch in enumerate(_loader(inputs.eval_rows, packs, train, accelerator)):
        batch = to_device(batch, accelerator.device, float_dtype)
        _, batch_stats, top1 = model(**batch, ttt_steps=steps, step_weights=weights)
        stats += batch_stats
        if ks:
            batch_packs = packs[index * train.micro_batch_size:(index + 1) * train.micro_batch_size]
            replay_batch(target_proposals(top1, d2t), batch, [pack for _, pack in batch_packs], inputs.eval_samples,
                         config.validate_.max_tokens, chains)
    values = summarize(accelerator.reduce(stats[:, :train.ttt_steps], "sum"), train.loss)
    if not ks:
        return values
    counts = torch.tensor([c.as_list() for c in chains.values()], dtype=torch.float64, device=accelerator.device)
    summed = accelerator.reduce(counts, "sum")
    chains = {key: AcceptanceCounts.from_list(key[1], row.tolist()) for key, row in zip(chains, summed)}
    return values | chain_metrics(chains)


def final_counts(eval_values: dict | None, meter: Throughput, train) -> dict:
    return {"steps": train.max_steps, "train_tokens_this_launch": meter.total_tokens, **eval_summary(eval_values)}
