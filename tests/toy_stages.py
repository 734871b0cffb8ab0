"""Two toy stages on the real stage contract, driven through the same command-line wrapper as 01-06.

`01_data` writes numbers.json (count from data.max_seq_len); `03_vocab` reads it and writes sum.json.
`--die-midway` kills the process with SIGKILL halfway through writing the output (an interrupted stage).
"""

from __future__ import annotations

import json
import os
import signal

from eagle3_pipeline.cli import run_stage, stage_parser
from eagle3_pipeline.stage_io import Stage


def produce_numbers(config, force=False, die_midway=False):
    stage = Stage(config, "01_data", force=force)
    if stage.is_complete():
        return
    stage.begin()
    numbers = list(range(config.data.max_seq_len))
    with stage.atomic("numbers.json") as tmp:
        with open(tmp, "w") as f:
            f.write(json.dumps(numbers)[: len(numbers)])
            f.flush()
            if die_midway:
                os.kill(os.getpid(), signal.SIGKILL)
            f.write(json.dumps(numbers)[len(numbers):])
    stage.finish(counts={"numbers": len(numbers)})


def sum_numbers(config, force=False, die_midway=False):
    stage = Stage(config, "03_vocab", force=force)
    if stage.is_complete():
        return
    stage.begin()
    numbers = json.loads((stage.input_dir("01_data") / "numbers.json").read_text())
    with stage.atomic("sum.json") as tmp:
        tmp.write_text(json.dumps(sum(numbers)))
    stage.finish(counts={"sum": sum(numbers)})


if __name__ == "__main__":
    parser = stage_parser(__doc__)
    parser.add_argument("--stage", choices=["01_data", "03_vocab"], required=True)
    parser.add_argument("--die-midway", action="store_true")

    def run(config, args):
        stage_fn = produce_numbers if args.stage == "01_data" else sum_numbers
        stage_fn(config, force=args.force, die_midway=args.die_midway)

    run_stage(parser, run)
