"""What one stream item costs each side on the host, apart from capture and training: 02 encodes a pack's states
and puts it in the window (capture.stream.transport directory), 04 gets it, checks it (shapes, dtype, every value
finite) and decodes each sample's rows. In stream mode these are paid once per pack, between engine calls on 02's
side and inside 04's wait for data (docs/stream.md).

    python -m bench.stream_items                             # the GPU demo's pack and Kimi-K2.5's
    python -m bench.stream_items --shapes demo --repeats 10  # one shape

Shapes: `demo` is configs/demo_gpu.yaml's pack (8,192 rows of SmolLM2's four 576-wide states, 400-token samples),
`kimi` configs/kimi_k25.yaml's (16,384 rows of four 7,168-wide states, 3,000-token samples). Writes
bench/results/stream_items.{json,md}; the median of the repeats per step, in ms.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.harness import RESULTS, parser, save, versions
from eagle3_pipeline.capture import store
from eagle3_pipeline.capture.stream import PackItem, decode_item, encode_item
from eagle3_pipeline.capture.stream_directory import DirectoryTransport

# name: (rows in a pack, aux states, hidden size, tokens a sample)
SHAPES = {"demo": (8192, 3, 576, 400), "kimi": (16384, 3, 7168, 3000)}
STEPS = ("encode", "put", "get", "check and decode")


def pack(rows: int, num_aux: int, hidden: int, sample_tokens: int) -> tuple[PackItem, list[tuple[str, int]]]:
    """A pack of random bf16 states cut into samples of `sample_tokens` (the last one shorter)."""
    lengths = [min(sample_tokens, rows - start) for start in range(0, rows, sample_tokens)]
    samples = [store.SampleStates(f"s{i}", torch.randn(n, num_aux, hidden).bfloat16(), torch.randn(n, hidden).bfloat16())
               for i, n in enumerate(lengths)]
    return PackItem(0, 0, samples), [(s.sample_id, n) for s, n in zip(samples, lengths)]


def time_steps(shape: str, repeats: int, folder: Path) -> dict:
    rows, num_aux, hidden, sample_tokens = SHAPES[shape]
    item, expected = pack(rows, num_aux, hidden, sample_tokens)
    transport = DirectoryTransport(folder)
    times: dict[str, list[float]] = {step: [] for step in STEPS}
    for _ in range(repeats):
        started = time.perf_counter()
        data = encode_item(item, "bfloat16")
        encoded = time.perf_counter()
        transport.put(0, data)
        put = time.perf_counter()
        got = transport.get(0)
        read = time.perf_counter()
        decode_item(got, 0, expected, num_aux, hidden, "bfloat16")
        decoded = time.perf_counter()
        transport.delete(0)
        for step, seconds in zip(STEPS, (encoded - started, put - encoded, read - put, decoded - read)):
            times[step].append(seconds * 1000)
    return {"rows": rows, "num_aux": num_aux, "hidden_size": hidden, "samples": len(expected), "bytes": len(data),
            "ms": {step: statistics.median(values) for step, values in times.items()}, "ms_each": times}


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["demo", "kimi"])
    cli.add_argument("--repeats", type=int, default=5)
    cli.add_argument("--out", type=Path, default=RESULTS / "stream_items")
    args = cli.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        results = {shape: time_steps(shape, args.repeats, Path(folder)) for shape in args.shapes}
    command = f"python -m bench.stream_items --shapes {' '.join(args.shapes)} --repeats {args.repeats}"
    save(args.out.with_suffix(".json"), {"command": command, "threads": torch.get_num_threads(),
                                         "versions": versions(), "results": results})
    lines = [f"# One stream item's host cost per side ({torch.get_num_threads()} threads)", "", f"    {command}", "",
             "| pack | MB | 02: " + " ms | 02: ".join(STEPS[:2]) + " ms | 04: " + " ms | 04: ".join(STEPS[2:]) + " ms |",
             "|---|---|---|---|---|---|"]
    for shape, result in results.items():
        ms = result["ms"]
        lines.append(f"| {shape} ({result['rows']:,} rows x {result['num_aux'] + 1} x {result['hidden_size']}) | "
                     f"{result['bytes'] / 1e6:,.1f} | " + " | ".join(f"{ms[step]:,.1f}" for step in STEPS) + " |")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
