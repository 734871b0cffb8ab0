"""Stage 02: the target's hidden states for every sample of stage 01, as verified safetensors shards.

Work is cut into shards of `capture.samples_per_shard` samples in a fixed order (train, then eval). Job
`i` of `N` (`--shard-index i --num-shards N`) takes shards k with k % N == i, so independent jobs split the
work with no overlap and no coordination. A shard counts as done only once its file verifies (readable,
expected tokens, shapes, dtype) and its index part is written; a rerun skips done shards and redoes the
rest. The job that finds every shard done writes `index.json` and the manifest.

With `capture.mode: stream` only the eval split goes into shards; the train split is captured while 04 trains,
pack by pack in 04's order, through a bounded window (stream.py). The job that completes the eval shards opens
the stream (`stream.json`: 04 starts on it), and the stage finishes when 04 has finished.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from eagle3_pipeline.capture import store, stream, stream_producer
from eagle3_pipeline.config import ConfigError, RunConfig
from eagle3_pipeline.data.dataset import SPLITS, open_split
from eagle3_pipeline.pack_plan import plan_settings, run_pack_stream
from eagle3_pipeline.stage_io import Stage, StageError, stream_identity, write_json_atomic
from eagle3_pipeline.target import run_aux_layer_ids, target_path, text_config

LAYER_ID_CONVENTION = (
    "vLLM: aux id i is the residual stream entering decoder layer i (hidden_states + residual), equal to "
    "Hugging Face output_hidden_states[i]; `final` is the last decoder layer's output before the final norm"
)


@dataclass(frozen=True)
class Sample:
    sample_id: str
    split: str
    input_ids: list[int]  # as vLLM prompts the sample: image placeholders expanded (vision.py)
    images: tuple[bytes, ...] = ()  # the file bytes of its images, in order


@dataclass(frozen=True)
class ShardPlan:
    number: int
    samples: list[Sample]

    @property
    def file(self) -> str:
        return f"shard_{self.number:05d}.safetensors"

    @property
    def tokens(self) -> int:
        return sum(len(s.input_ids) for s in self.samples)


def load_samples(data_dir: Path) -> list[Sample]:
    samples = []
    for split in SPLITS:
        dataset = open_split(data_dir, split).select_columns(["id", "input_ids", "images"])
        samples += [Sample(row["id"], split, list(row["input_ids"]), tuple(row["images"])) for row in dataset]
    return samples


def plan_shards(samples: list[Sample], samples_per_shard: int) -> list[ShardPlan]:
    return [
        ShardPlan(k, samples[start : start + samples_per_shard])
        for k, start in enumerate(range(0, len(samples), samples_per_shard))
    ]


def shard_is_done(stage: Stage, plan: ShardPlan, num_aux: int, hidden_size: int, dtype: str) -> bool:
    part = stage.path(plan.file + ".json")
    if not part.exists():
        return False
    return store.verify_shard(stage.path(plan.file), plan.tokens, num_aux, hidden_size, dtype) is None


def run(config: RunConfig, force: bool = False, shard_index: int = 0, num_shards: int = 1,
        ignore_disk_check: bool = False) -> None:
    """Stage 02: job `shard_index` of `num_shards` captures its shards of 01's samples (in stream mode, the eval
    split, then 04's packs while 04 trains); the job that completes the last shard writes the index."""
    stage = Stage(config, "02_hidden_states", force=force)
    if stage.is_complete():
        return
    stage.check_inputs()  # the config checks below come before begin(): a refused config leaves nothing to --force

    # What to capture: the aux layers, plus the final layer output the training targets need.
    model_dir = target_path(config.target)
    text = text_config(model_dir)
    num_layers, hidden_size = text["num_hidden_layers"], text["hidden_size"]
    aux_layer_ids = run_aux_layer_ids(config, num_layers)
    if max(aux_layer_ids) >= num_layers:
        raise ConfigError(f"capture.aux_layer_ids {aux_layer_ids}: the target has {num_layers} layers (ids 0..{num_layers - 1})")
    with stage.timed("load_samples"):
        samples = load_samples(stage.input_dir("01_data"))
    longest = max(len(s.input_ids) for s in samples)
    if longest >= config.target.engine.max_model_len:  # vLLM prefills a sample and generates one token
        raise ConfigError(f"target.engine.max_model_len {config.target.engine.max_model_len} leaves no room for the "
                          f"longest sample of 01_data ({longest} tokens) and one generated token: raise it to "
                          f"{longest + 1} or lower data.max_seq_len, then rerun from 01_prepare_data.py --force")
    stage.begin()
    dtype, streaming = config.capture.dtype, config.capture.mode == "stream"
    print(f"aux layers {aux_layer_ids} + final (layer {num_layers} output), hidden {hidden_size}, {dtype}, "
          f"{config.capture.mode} mode")

    # Offline, every sample goes into shards; streaming, only the eval split (04 evaluates on it again and again).
    plans = plan_shards([s for s in samples if not streaming or s.split == "eval"], stage.layout_knob("capture.samples_per_shard"))
    # Jobs that share no folder (Mooncake transport): job 0 captures the eval split and publishes the folder
    # with the stream's header; the other jobs fetch it before they stream.
    shared = not streaming or stream.shares_folder(config)
    if not shared and shard_index > 0:
        stream.fetch_folder(config, stage.dir, f"02_hidden_states job {shard_index}/{num_shards}")
    mine = [p for p in plans if (p.number % num_shards if shared else 0) == shard_index]
    todo = [p for p in mine if not shard_is_done(stage, p, len(aux_layer_ids), hidden_size, dtype)]
    per_token = store.bytes_per_token(len(aux_layer_ids), hidden_size, dtype)
    print(f"shards: {len(plans)} in all, {len(mine)} for job {shard_index}/{num_shards}, {len(todo)} to capture")
    check_disk(stage, samples, todo, per_token, ignore_disk_check)

    text_only = not any(s.images for s in samples)  # no image encoder to load or profile
    capturer = functools.cache(lambda: open_capturer_for(config, model_dir, text, aux_layer_ids, text_only))
    if todo:
        with stage.timed("capture"):
            capture_shards(stage, config, capturer(), hidden_size, todo, aux_layer_ids)

    missing = [p.file for p in plans if not shard_is_done(stage, p, len(aux_layer_ids), hidden_size, dtype)]
    layout = states_layout(aux_layer_ids, num_layers, hidden_size, dtype)
    if missing:
        print(f"job {shard_index}/{num_shards}: {len(missing)} shards of other jobs still missing (the job that "
              f"completes the last one writes the index{' and opens the stream' if streaming else ''})")
    else:
        write_index(stage, plans, layout)
    if not streaming:
        if not missing:
            stage.finish(counts=shard_counts(stage, plans), extra=layout_record(layout))
        return
    if not missing:
        open_stream(stage, layout)
    transport = open_stream_transport(stage, config, per_token, publish=not shared, num_shards=num_shards)
    with stage.timed("stream"):
        counts = stream_packs(stage, config, capturer, transport, [s for s in samples if s.split == "train"],
                              layout, shard_index, num_shards)
    if counts is not None:
        stage.finish(counts={**shard_counts(stage, plans), "stream": counts}, extra=layout_record(layout))


def states_layout(aux_layer_ids: list[int], num_layers: int, hidden_size: int, dtype: str) -> store.StatesLayout:
    return store.StatesLayout(list(aux_layer_ids), num_layers, LAYER_ID_CONVENTION, hidden_size, dtype)


def layout_record(layout: store.StatesLayout) -> dict:
    """The layout and the bytes each token's states take: what 02's manifest and stream.json carry."""
    return {"layout": layout.to_json(), "bytes_per_token": layout.bytes_per_token}


def open_stream(stage: Stage, layout: store.StatesLayout) -> None:
    """stream.json: the eval shards are complete and 04 may start on the stream, in the pack plan of this config."""
    stage.open_stream({**layout_record(layout), "pack_plan": plan_settings(stage.config)})


def open_capturer_for(config: RunConfig, model_dir: Path, text: dict, aux_layer_ids: list[int], text_only: bool):
    from eagle3_pipeline.capture.engine import open_capturer  # imports vLLM: only where it is needed

    return open_capturer(config, model_dir, text, aux_layer_ids, text_only)


def check_disk(stage: Stage, samples: list[Sample], todo: list[ShardPlan], per_token: int, ignore: bool) -> None:
    """The disk plan of both modes for this data; refuses to start when this job's part does not fit."""
    total = sum(len(s.input_ids) for s in samples)
    train = sum(len(s.input_ids) for s in samples if s.split == "train")
    settings = stage.config.capture.stream
    print(f"disk plan: offline {total:,} tokens x {per_token:,} B/token = {total * per_token / 2**30:.2f} GiB; "
          f"stream: the eval split's {(total - train) * per_token / 2**30:.2f} GiB + a window of "
          f"{settings.window_gb:g} GB (capture.stream.window_gb), {train:,} train tokens captured again each epoch")
    needed = sum(p.tokens for p in todo) * per_token
    if stage.config.capture.mode == "stream" and stream.transport_class(stage.config).window_in_stage_folder(settings):
        needed += int(settings.window_gb * 1e9)
    free = shutil.disk_usage(stage.dir).free
    print(f"disk: this job needs {needed / 2**30:.2f} GiB, {free / 2**30:.1f} GiB free")
    if needed > free and not ignore:
        raise StageError(f"{stage.dir}: not enough free disk ({free / 2**30:.1f} GiB < {needed / 2**30:.2f} GiB); "
                         "free space, or pass --ignore-disk-check")


def prompts_of(batch: list[Sample]) -> list[tuple[list[int], list]]:
    return [(s.input_ids, list(s.images)) for s in batch]


def checked(batch: list[Sample], states: list, num_aux: int, hidden_size: int) -> list[store.SampleStates]:
    """A batch's captured states, each checked against its sample's token count."""
    captured = []
    for sample, (aux, final) in zip(batch, states):
        if aux.shape != (len(sample.input_ids), num_aux, hidden_size):
            raise StageError(f"sample {sample.sample_id}: captured aux {tuple(aux.shape)} does not match "
                             f"{len(sample.input_ids)} tokens x {num_aux} layers x {hidden_size}")
        captured.append(store.SampleStates(sample.sample_id, aux, final))
    return captured


def capture_shards(stage: Stage, config: RunConfig, capturer, hidden_size: int, todo: list[ShardPlan],
                   aux_layer_ids: list[int]) -> None:
    """Every shard of `todo`, its batches captured back to back (capture_batches overlaps each batch's copy out
    of vLLM with the next batch's prefill) and each shard written in a thread while the next is captured."""
    batch_size = config.capture.batch_size
    batches = [(plan, plan.samples[start : start + batch_size])
               for plan in todo for start in range(0, len(plan.samples), batch_size)]
    states = capturer.capture_batches(prompts_of(batch) for _, batch in batches)
    total_tokens, started = sum(p.tokens for p in todo), time.perf_counter()
    captured: list[store.SampleStates] = []
    with tqdm(total=total_tokens, unit="tok", desc="capture") as progress, ThreadPoolExecutor(1) as writer:
        writing = None
        for (plan, batch), batch_states in zip(batches, states):
            captured += checked(batch, batch_states, len(aux_layer_ids), hidden_size)
            progress.update(sum(len(s.input_ids) for s in batch))
            if batch[-1] is plan.samples[-1]:  # the shard's last batch
                if writing is not None:
                    writing.result()  # one shard in memory while another is written, at most
                writing = writer.submit(write_shard_files, stage, plan, captured, config.capture.dtype)
                captured = []
        if writing is not None:
            writing.result()
    elapsed = time.perf_counter() - started
    print(f"captured {total_tokens:,} tokens in {elapsed:.1f} s ({total_tokens / elapsed:,.0f} tokens/s): "
          f"{time_split(capturer.seconds)}")


def time_split(seconds) -> str:
    """Where a capture's time went (capture/engine.py's CaptureSeconds), in words."""
    said = (f"prefills {seconds.prefill:.1f} s, reading the states {seconds.collect:.1f} s, of which "
            f"{seconds.waited:.1f} s not hidden behind a prefill")
    worker = seconds.worker
    if worker:
        device = (f"; on the GPU, forwards {worker['forward_device']:.1f} s and copies out "
                  f"{worker['copy_device']:.1f} s" if "forward_device" in worker else "")
        said += (f" (the worker: {worker['steps']} steps, recording {worker['record_host']:.1f} s and handing over "
                 f"{worker['pop_host']:.1f} s of host time{device})")
    return said


def open_stream_transport(stage: Stage, config: RunConfig, per_token: int, publish: bool, num_shards: int):
    """This job's transport; with `publish` (Mooncake, job 0) it first puts the folder the other nodes fetch."""
    identity = stream_identity(stage.dir)  # None while another job (sharing this folder) completes the eval split
    names = stream.published_names(stage.dir) if publish else []
    published = sum(stage.path(name).stat().st_size for name in names)
    lend = stream.transport_class(config).lend_bytes(
        config.capture.stream, stream_producer.share_bytes(config.capture.stream, num_shards), published)
    transport = stream.open_transport(config, identity, stream.largest_item_bytes(config, per_token), lend)
    if publish:
        transport.clear_other_streams()
        transport.publish(stage.dir, names)
        print(f"stream: published the stream header and eval states ({len(names)} files, {published / 1e6:.1f} MB) "
              f"in {transport.describe()}")
    return transport


def write_shard_files(stage: Stage, plan: ShardPlan, captured: list[store.SampleStates], dtype: str) -> None:
    """One shard and its index part, the shard verified after writing: what makes a shard count as done."""
    entries = store.write_shard(stage.path(plan.file), captured, dtype)
    num_aux, hidden_size = captured[0].aux.shape[1:]
    problem = store.verify_shard(stage.path(plan.file), plan.tokens, num_aux, hidden_size, dtype)
    if problem:
        raise StageError(f"shard failed verification after writing: {problem}")
    splits = {s.sample_id: s.split for s in plan.samples}
    write_json_atomic(stage.path(plan.file + ".json"), {k: {**asdict(v), "split": splits[k]} for k, v in entries.items()})


def stream_packs(stage: Stage, config: RunConfig, capturer, transport, train: list[Sample], layout: store.StatesLayout,
                 shard_index: int, num_shards: int) -> dict | None:
    """Capture 04's packs in its order until 04 has finished; the stream's counts once every job has
    finished (the last one writes the manifest and ends the stream), else None."""
    packs = run_pack_stream(config, [len(s.input_ids) for s in train])
    per_token = layout.bytes_per_token
    producer = stream_producer.Producer(transport, config.capture.stream, shard_index, num_shards,
                                        identity=lambda: stream_identity(stage.dir))
    print(f"stream: job {shard_index}/{num_shards} captures positions p % {num_shards} == {shard_index} of 04's pack "
          f"stream into {transport.describe()}, within {producer.share / 1e9:.3f} GB"
          + (f" (and {producer.ahead / 1e9:.3f} GB captured ahead in host memory)" if producer.ahead else ""))

    def item_bytes(pack: tuple[int, ...]) -> int:
        return sum(len(train[i].input_ids) for i in pack) * per_token + stream.ITEM_HEADER_BYTES

    # (items, samples) of the batches being captured or put, in order: the oldest may be the writer's; an item is
    # (position, epoch, samples in its pack), read from the pack plan here, in the engine's thread only (it plans
    # epochs as the stream reaches them)
    in_flight: collections.deque = collections.deque()
    writing = None  # the writer's batch (a future): encoded and put while the engine captures the next one

    def batches():
        """The next batch of 04's packs as soon as the window has room; while a batch is in flight, the window
        is asked without waiting (its room may come only once that batch is put): None hands a captured batch
        over first, and a batch being put is waited for where it is the only one in flight."""
        while (positions := producer.next_positions(packs.pack, item_bytes, config.capture.batch_size,
                                                    wait=not in_flight)) != []:
            if positions is None:
                if writing is not None and len(in_flight) == 1:
                    finish_writing()
                    continue
                yield None
                continue
            items = [(p, packs.locate(p)[0], len(packs.pack(p))) for p in positions]
            in_flight.append((items, [train[i] for p in positions for i in packs.pack(p)]))
            yield prompts_of(in_flight[-1][1])

    def put_batch(items: list[tuple[int, int, int]], captured: list[store.SampleStates]) -> None:
        """Encode and put a captured batch's items (in the writer thread)."""
        samples = iter(captured)
        for position, epoch, num_samples in items:
            started = time.perf_counter()
            item = stream.PackItem(position, epoch, [next(samples) for _ in range(num_samples)])
            data = stream.encode_item(item, layout.dtype)
            encoded = time.perf_counter()
            producer.put(position, data, sum(s.final.shape[0] for s in item.samples))
            producer.counts["encode_s"] += encoded - started
            producer.counts["put_s"] += time.perf_counter() - encoded
            progress.update()

    def finish_writing() -> None:
        """Wait for the writer's batch (raising its error here), then let it leave the batches in flight."""
        nonlocal writing
        if writing is not None:
            writing.result()
            writing = None
            in_flight.popleft()

    progress = tqdm(unit="pack", desc="stream capture")
    waiting = batches()
    first = next(waiting, None)  # the engine starts only if 04 asks for anything
    with ThreadPoolExecutor(1, thread_name_prefix="stream-writer") as writer:
        try:
            for states in [] if first is None else capturer().capture_batches(itertools.chain([first], waiting)):
                finish_writing()  # one batch in the writer at most
                items, batch = in_flight[0]
                producer.batch_captured()
                writing = writer.submit(put_batch, items,
                                        checked(batch, states, len(layout.aux_layer_ids), layout.hidden_size))
            finish_writing()
        finally:
            producer.cancel()  # a put still waiting for room stops (after an error; else none waits)
    progress.close()
    if first is not None:
        print(f"stream: {time_split(capturer().seconds)}")
    if not producer.finish():
        print(f"stream: 04_train finished; job {shard_index}/{num_shards} done, others still running (the last "
              "one to finish writes the manifest)")
        return None
    totals = producer.totals()
    transport.end_stream()
    print(f"stream: captured {totals['packs']:,} packs in {totals['batches']:,} engine calls, {totals['tokens']:,} "
          f"tokens; the jobs waited {totals['waited_s']:.1f} s in all for 04; their writers encoded the packs in "
          f"{totals['encode_s']:.1f} s and put them in {totals['put_s']:.1f} s, beside the engine's calls")
    return totals


def write_index(stage: Stage, plans: list[ShardPlan], layout: store.StatesLayout) -> None:
    entries, splits = {}, {}
    for plan in plans:
        for sample_id, part in json.loads(stage.path(plan.file + ".json").read_text()).items():
            splits[sample_id] = part.pop("split")
            entries[sample_id] = store.IndexEntry(**part)
    store.write_index(stage.dir, entries, layout, splits)


def shard_counts(stage: Stage, plans: list[ShardPlan]) -> dict:
    return {"samples": sum(len(p.samples) for p in plans), "shards": len(plans), "tokens": sum(p.tokens for p in plans),
            "bytes_on_disk": sum(stage.path(p.file).stat().st_size for p in plans)}
