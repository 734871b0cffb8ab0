"""The stream's hand-over alone, at a GPU run's pace: how much of 04's time goes to waiting for packs when 02 makes
them fast enough. The window, the directory transport, both sides' host work (02 encodes and puts each pack in a
writer thread; 04's loader workers get, check and decode it) and their coordination are the pipeline's own
(Producer, Consumer); only the GPU's work is stood in for: 02's engine call (capture ms per pack) and 04's
training step (train ms per pack), by sleeps or, with `--device cuda`, by matrix products on the GPU that take
that long on an idle GPU, so 02 and 04 share one GPU as they do in stream mode on one GPU.

    python -m bench.stream_handoff                          # the GPU demo's pace, both capture paths, both polls
    python -m bench.stream_handoff --capture-ms 62 --first-poll-s 0.2 --steps 60
    python -m bench.stream_handoff --device cuda            # the two sides' GPU work on one shared GPU
    python -m bench.stream_handoff --call-ms 90 --ahead-gb 0 0.1   # a fixed cost per engine call; 02 capturing
                                                            # ahead of the window's room (capture.stream.ahead_gb)

The defaults are the H100 run's (bench/results/gpu_pipeline.md): a pack of 8,192 rows (37.7 MB) trains in 44 ms;
extract_hidden_states captured 60 packs in 3.7 s of prefill (62 ms a pack), the worker extension captures the same
tokens in 56% of that time (41 ms). `--first-poll-s 0.2` makes every look of a waiting side 0.2 s apart (the
old behaviour); 0.001 is the pipeline's (1 ms, then doubling up to poll_s). Packs of 2,048 rows keep the host's
work small where few cores would otherwise make it the bottleneck (bench/results/README.md). Writes
bench/results/stream_handoff.{json,md}.
"""

from __future__ import annotations

import collections
import functools
import itertools
import multiprocessing
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from bench.harness import RESULTS, parser, save, synchronize, versions
from bench.stream_items import SHAPES, pack
from eagle3_pipeline.capture import stream
from eagle3_pipeline.capture.stream import Consumer, PackItem, decode_item, encode_item
from eagle3_pipeline.capture.stream_directory import DirectoryTransport
from eagle3_pipeline.capture.stream_producer import Producer, producer_record
from eagle3_pipeline.config_sections import StreamConfig

IDENTITY = "stream-handoff"
BATCH_SAMPLES = 256  # configs/demo_gpu.yaml's capture.batch_size: samples per engine call, at most


class GpuWork:
    """A side's GPU work: bf16 matrix products, as many as take the asked seconds on an idle GPU (timed once, when
    made). Two processes doing it on one GPU take turns on it, as 02's engine and 04's training do."""

    def __init__(self, device: str, size: int):
        self.device = device
        self.matrix = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        self.product = torch.empty_like(self.matrix)
        self.products(10)  # warm-up
        count, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < 0.2:  # long enough that a moment's pause hardly counts
            self.products(10)
            count += 10
        self.product_s = elapsed / count

    def products(self, count: int) -> None:
        for _ in range(count):
            torch.mm(self.matrix, self.matrix, out=self.product)
        synchronize(self.device)

    def __call__(self, seconds: float) -> None:
        self.products(max(1, round(seconds / self.product_s)))


def gpu_work(device: str | None) -> Callable[[float], None]:
    """What stands in for the GPU's work: a sleep, or matrix products on `device` (4096-wide on a GPU)."""
    if device is None:
        return time.sleep
    return GpuWork(device, 4096 if torch.device(device).type == "cuda" else 64)


@functools.cache  # once per process
def demo_pack(rows: int) -> tuple[PackItem, list[tuple[str, int]], int]:
    """A pack of the GPU demo's states (`rows` of them), its (sample, rows) list and its item's bytes."""
    _, num_aux, hidden, sample_tokens = SHAPES["demo"]
    item, expected = pack(rows, num_aux, hidden, sample_tokens)
    return item, expected, len(encode_item(item, "bfloat16"))


def capture(folder: Path, settings: StreamConfig, capture_s: float, call_s: float, rows: int, device: str | None,
            engine_seconds) -> None:
    """02: the engine's thread asks for positions and works the engine's time per batch, `call_s` plus `capture_s`
    a pack (`engine_seconds` adds up what it took); a writer thread encodes and puts the batch before
    (capture/stage.py's stream_packs)."""
    item, expected, item_bytes = demo_pack(rows)
    engine = gpu_work(device)
    producer = Producer(DirectoryTransport(folder), settings, 0, 1, identity=lambda: IDENTITY)

    def put_batch(positions: list[int]) -> None:
        for position in positions:
            producer.put(position, encode_item(PackItem(position, 0, item.samples), "bfloat16"), rows)

    with ThreadPoolExecutor(1) as writer:
        writing = None
        while positions := producer.next_positions(lambda p: range(len(expected)), lambda pack: item_bytes,
                                                   BATCH_SAMPLES):
            started = time.perf_counter()
            engine(call_s + capture_s * len(positions))
            engine_seconds.value += time.perf_counter() - started
            producer.batch_captured()
            if writing is not None:
                writing.result()
            writing = writer.submit(put_batch, positions)
        if writing is not None:
            writing.result()
    producer.finish()


def load(folder: Path, settings: StreamConfig, position: int, rows: int) -> None:
    """A loader worker of 04: get the item (waiting for it), check and decode it."""
    _, num_aux, hidden, _ = SHAPES["demo"]
    expected = demo_pack(rows)[1]
    data = Consumer(DirectoryTransport(folder), settings, IDENTITY).get(position)
    decode_item(data, position, expected, num_aux, hidden, "bfloat16")


def set_first_poll(first_poll_s: float) -> None:
    stream.FIRST_POLL_S = first_poll_s


def run(folder: Path, steps: int, capture_s: float, train_s: float, first_poll_s: float, window_gb: float,
        poll_s: float, loader_workers: int, rows: int, device: str | None = None, call_s: float = 0.0,
        ahead_gb: float = 0.0) -> dict:
    """02 in a process of its own, 04's loader workers in processes, as the pipeline runs them (no shared GIL)."""
    set_first_poll(first_poll_s)
    train = gpu_work(device)
    settings = StreamConfig(window_gb=window_gb, ahead_gb=ahead_gb, poll_s=poll_s, wait_timeout_s=60)
    consumer = Consumer(DirectoryTransport(folder), settings, IDENTITY)
    consumer.advance(0, steps, 1, 0)
    spawn = multiprocessing.get_context("spawn")  # fork after torch's thread pools started may hang a child
    engine_seconds = spawn.Value("d", 0.0)
    capturing = spawn.Process(target=capture,
                              args=(folder, settings, capture_s, call_s, rows, device, engine_seconds))
    capturing.start()
    waits, step_seconds, train_seconds = [], [], []
    # each worker keeps two packs in flight, as a DataLoader with prefetch_factor 2
    with ProcessPoolExecutor(loader_workers, spawn, initializer=set_first_poll, initargs=(first_poll_s,)) as loaders:
        list(loaders.map(time.sleep, [1.0] * loader_workers))  # every worker started before the first step
        ahead = collections.deque(loaders.submit(load, folder, settings, p, rows)
                                  for p in range(min(steps, 2 * loader_workers)))
        for step in range(steps):
            started = time.perf_counter()
            ahead.popleft().result()
            got = time.perf_counter()
            if step + len(ahead) + 1 < steps:
                ahead.append(loaders.submit(load, folder, settings, step + len(ahead) + 1, rows))
            training = time.perf_counter()
            train(train_s)  # the training step
            train_seconds.append(time.perf_counter() - training)
            consumer.advance(step + 1, steps, 1, step + 1)
            waits.append(got - started)
            step_seconds.append(time.perf_counter() - started)
    consumer.finish(steps, 1, steps)
    capturing.join()
    record = DirectoryTransport(folder).read_record(producer_record(0, 1))
    # the first step waits for the first engine call whatever the hand-over does: steps 2.. as in bench/stream.py
    return {"capture_ms": capture_s * 1e3, "call_ms": call_s * 1e3, "ahead_gb": ahead_gb, "train_ms": train_s * 1e3,
            "first_poll_s": first_poll_s, "device": device,
            "capture_ms_taken": engine_seconds.value / record["packs"] * 1e3,  # the calls' cost included
            "train_ms_taken": sum(train_seconds[1:]) / (steps - 1) * 1e3,
            "data_wait_share": sum(waits[1:]) / sum(step_seconds[1:]), "steps_s": sum(step_seconds[1:]),
            "train_s": train_s * (steps - 1), "rate_floor": max(0.0, 1 - train_s / capture_s),
            "engine_calls": record["batches"], "packs": record["packs"], "bytes": record["bytes"],
            "producer_waited_s": record["waited_s"], "rows": rows, "pack_mb": record["bytes"] / record["packs"] / 1e6}


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--steps", type=int, default=60)
    cli.add_argument("--capture-ms", type=float, nargs="+", default=[62.0, 41.0], help="02's engine, per pack")
    cli.add_argument("--call-ms", type=float, default=0.0, help="02's engine, per call (on top of per pack)")
    cli.add_argument("--ahead-gb", type=float, nargs="+", default=[0.0], help="capture.stream.ahead_gb")
    cli.add_argument("--train-ms", type=float, default=44.0, help="04's step on one pack")
    cli.add_argument("--first-poll-s", type=float, nargs="+", default=[0.2, 0.001])
    cli.add_argument("--window-gb", type=float, default=0.4)
    cli.add_argument("--poll-s", type=float, default=0.2)
    cli.add_argument("--loader-workers", type=int, default=2)
    cli.add_argument("--rows", type=int, default=SHAPES["demo"][0], help="rows a pack (the demo's: 8192)")
    cli.add_argument("--device", default=None, help="the GPU's work as matrix products there (cuda), not sleeps")
    cli.add_argument("--out", type=Path, default=RESULTS / "stream_handoff")
    args = cli.parse_args()
    runs = []
    for capture_ms, first_poll_s, ahead_gb in itertools.product(args.capture_ms, args.first_poll_s, args.ahead_gb):
        with tempfile.TemporaryDirectory() as folder:
            runs.append(run(Path(folder), args.steps, capture_ms / 1e3, args.train_ms / 1e3, first_poll_s,
                            args.window_gb, args.poll_s, args.loader_workers, args.rows, args.device,
                            args.call_ms / 1e3, ahead_gb))
        print(runs[-1])
    command = (f"python -m bench.stream_handoff --steps {args.steps} --capture-ms {' '.join(map(str, args.capture_ms))}"
               f" --train-ms {args.train_ms} --first-poll-s {' '.join(map(str, args.first_poll_s))} --window-gb "
               f"{args.window_gb} --poll-s {args.poll_s} --loader-workers {args.loader_workers} --rows {args.rows}"
               f" --call-ms {args.call_ms} --ahead-gb {' '.join(map(str, args.ahead_gb))}"
               + (f" --device {args.device}" if args.device else ""))
    save(args.out.with_suffix(".json"), {"command": command, "threads": torch.get_num_threads(),
                                         "versions": versions(), "runs": runs})
    work = f"matrix products on {args.device}" if args.device else "sleeps"
    lines = [f"# The stream's hand-over at a GPU run's pace, the GPU's work as {work} "
             f"({torch.get_num_threads()} threads)", "", f"    {command}", "",
             "| 02 capture ms/pack asked / taken (calls included) | 02 ms/call | 02 ahead GB | "
             "04 train ms/pack asked / taken | first look after | 04 waits, share of steps 2.. | "
             "steady-state floor, 1 - train/capture | 02 engine calls | 02 waited for room s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['capture_ms']:.0f} / {r['capture_ms_taken']:.0f} | {r['call_ms']:g} | "
                     f"{r['ahead_gb']:g} | {r['train_ms']:.0f} / "
                     f"{r['train_ms_taken']:.0f} | {r['first_poll_s'] * 1e3:g} ms | {r['data_wait_share']:.1%} | "
                     f"{r['rate_floor']:.1%} | {r['engine_calls']} | {r['producer_waited_s']:.1f} |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
