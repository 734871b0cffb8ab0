"""How fast 02's main process reads the worker extension's states out of the mapped slabs (capture/handover.py's
`load_captured`) on this host: the part of the capture that bench/capture_overhead.py found the capture waiting
for on an H100 host (results/gpu_pipeline.md, "Latest run"). No GPU and no engine: the worker's own recording path
(`_record_step`, `pop_captured`) runs on host tensors into slabs that are not page-locked, which the read does not
tell apart.

    python -m bench.handover_read [--hidden 576] [--aux 3] [--requests 256] [--tokens 220] [--step-tokens 16384]
        [--rounds 8] [--beside-python] --out O.json

Each round records `--requests` prompts of `--tokens` tokens in steps of at most `--step-tokens` (a request that
does not fit is chunked into the next step, as vLLM's scheduler does), hands them over and reads them in a thread,
as 02's capturer does; the states of the last two rounds stay held, as 02 holds a shard's while writing it.
`--beside-python`: the main thread runs Python meanwhile, a stand-in for `llm.generate`'s own work beside the read.
Per round: seconds, GB/s and the minor page faults the process took while reading; the median GB/s after the
first three rounds, whose states are memory new to the process.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch

from bench.harness import parser, save
from eagle3_pipeline.capture.handover import load_captured
from eagle3_pipeline.capture.worker import HiddenStateCapture


def steps_of(num_requests: int, tokens: int, step_tokens: int) -> list[list[tuple[int, int, int]]]:
    """The engine's steps for a batch: per step, (request, first token, end) of each chunk it computes."""
    steps, step, room = [], [], step_tokens
    for request in range(num_requests):
        begin = 0
        while begin < tokens:
            end = min(tokens, begin + room)
            step.append((request, begin, end))
            room -= end - begin
            begin = end
            if room == 0:
                steps.append(step)
                step, room = [], step_tokens
    return steps + ([step] if step else [])


def recorded_round(worker: HiddenStateCapture, round_index: int, args, states: torch.Tensor) -> tuple[list, dict]:
    """One batch recorded step by step and handed over: the outputs vLLM would return, and `pop_captured`'s result."""
    prompts = [torch.randint(0, 50_000, (args.tokens,), dtype=torch.int32) for _ in range(args.requests)]
    for step in steps_of(args.requests, args.tokens, args.step_tokens):
        starts = [0]
        for _, begin, end in step:
            starts.append(starts[-1] + end - begin)
        rows = starts[-1]
        batch = ([f"{round_index}-{r}" for r, _, _ in step], starts,
                 torch.cat([prompts[r][begin:end] for r, begin, end in step]))
        positions = torch.cat([torch.arange(begin, end) for _, begin, end in step])
        worker._record_step(batch, list(states[: args.aux, :rows]), states[args.aux, :rows], positions)
    outputs = [SimpleNamespace(request_id=f"{round_index}-{r}", prompt_token_ids=prompt.tolist())
               for r, prompt in enumerate(prompts)]
    return outputs, worker.pop_captured(tempfile.gettempdir())


def python_work(until) -> None:
    """Dictionary and list churn, like a request's processing, until the read is done."""
    table = {}
    while not until.done():
        for i in range(1000):
            table[i] = [i, str(i)]


def measured(args) -> dict:
    worker = HiddenStateCapture.without_engine(args.aux, "mapped")
    states = torch.randn(args.aux + 1, args.step_tokens, args.hidden).to(torch.bfloat16)
    nbytes = args.requests * args.tokens * ((args.aux + 1) * args.hidden * 2 + 2 * 8)  # states, token ids, positions
    slabs, held, rounds = {}, [], []
    with ThreadPoolExecutor(1, thread_name_prefix="collect") as collector:
        for index in range(args.rounds):
            outputs, captured = recorded_round(worker, index, args, states)
            faults, started = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
            reading = collector.submit(load_captured, outputs, captured, slabs)
            if args.beside_python:
                python_work(reading)
            held = [*held[-1:], reading.result()]
            seconds = time.perf_counter() - started
            rounds.append({"seconds": round(seconds, 4), "GB_per_s": nbytes / seconds / 1e9,
                           "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults})
    # the first three rounds' states (two held, one being read) are memory new to the process, faulted in
    steady = [r["GB_per_s"] for r in rounds[3:]] or [r["GB_per_s"] for r in rounds]
    return {"shape": {name: getattr(args, name) for name in ("hidden", "aux", "requests", "tokens", "step_tokens")},
            "beside_python": args.beside_python, "torch_threads": torch.get_num_threads(),
            "bytes_per_round": nbytes, "rounds": rounds,
            "median_GB_per_s_after_three_rounds": statistics.median(steady)}


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--hidden", type=int, default=576, help="the target's hidden size (SmolLM2's)")
    arguments.add_argument("--aux", type=int, default=3, help="aux layers captured")
    arguments.add_argument("--requests", type=int, default=256, help="prompts a batch (capture.batch_size)")
    arguments.add_argument("--tokens", type=int, default=220, help="tokens a prompt")
    arguments.add_argument("--step-tokens", type=int, default=16384, help="tokens an engine step computes at most")
    arguments.add_argument("--rounds", type=int, default=8)
    arguments.add_argument("--beside-python", action="store_true")
    arguments.add_argument("--out", type=Path, required=True)
    args = arguments.parse_args()
    result = measured(args)
    save(args.out, result)
    for index, row in enumerate(result["rounds"]):
        print(f"round {index}: {row['seconds'] * 1e3:.0f} ms, {row['GB_per_s']:.2f} GB/s, {row['minor_faults']} faults")
    print(f"median after three rounds: {result['median_GB_per_s_after_three_rounds']:.2f} GB/s "
          f"({result['torch_threads']} torch threads)")


if __name__ == "__main__":
    main()
