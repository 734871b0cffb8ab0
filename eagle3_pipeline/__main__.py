"""Utility commands beside the numbered stage scripts.

    python -m eagle3_pipeline config configs/demo.yaml [--set train.max_steps=10]   # validate, print resolved
    python -m eagle3_pipeline stand-ins [NAME ...]                                  # build stand-in targets
    python -m eagle3_pipeline stages [--config configs/demo.yaml]                   # the stages, in order
                                                                                    # (and their state in run_dir)
    python -m eagle3_pipeline config-reference                                      # docs/config.md
    python -m eagle3_pipeline plan configs/kimi_k25.yaml --conversations 600000 --answer-tokens 1000 3000
                                                                                    # GPU-hours per stage
"""

from __future__ import annotations

import argparse
import sys

import yaml

from eagle3_pipeline.config import ConfigError, RunConfig, load_config
from eagle3_pipeline.config_reference import reference
from eagle3_pipeline.plan import PlanError, render
from eagle3_pipeline.stage_io import STAGES, Stage, StageError
from eagle3_pipeline.stand_ins import BUILDERS, GPU_ONLY, ensure_stand_in


def parser() -> argparse.ArgumentParser:
    """The utility commands' command line."""
    parser = argparse.ArgumentParser(prog="python -m eagle3_pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("config", help="validate a run config and print it resolved")
    check.add_argument("path")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    build = commands.add_parser("stand-ins", help="build stand-in targets into the cache")
    build.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(BUILDERS)} (default: all but "
                       f"{', '.join(GPU_ONLY)}, which train on a GPU)")
    stages = commands.add_parser("stages", help="list the stages: script, module, what each reads and writes; with "
                                 "--config, each one's state in the config's run_dir (complete, stale and why, "
                                 "partial, missing)")
    stages.add_argument("--config", help="a run config: show each stage's state in its run_dir")
    stages.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    commands.add_parser("config-reference", help="print docs/config.md: every knob, type, default, description")
    add_plan_parser(commands)
    return parser


def main() -> int:
    """The utility command named on the command line; its exit code."""
    args = parser().parse_args()

    if args.command == "stages":
        try:
            config = load_config(args.config, args.overrides) if args.config else None
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        print_stages(config)
        return 0
    if args.command == "config-reference":
        print(reference(), end="")
        return 0

    if args.command == "plan":
        try:
            print(plan_text(args), end="")
        except (ConfigError, PlanError) as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        return 0
    if args.command == "config":
        try:
            config = load_config(args.path, args.overrides)
        except ConfigError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
        print(yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False), end="")
        return 0
    unknown = sorted(set(args.names) - set(BUILDERS))
    if unknown:
        print(f"unknown stand-in {', '.join(unknown)}; choose from {', '.join(BUILDERS)}", file=sys.stderr)
        return 2
    for name in args.names or [name for name in BUILDERS if name not in GPU_ONLY]:
        try:
            print(f"{name}: {ensure_stand_in(name)}")
        except StageError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
    return 0


def add_plan_parser(commands: argparse._SubParsersAction) -> None:
    plan = commands.add_parser("plan", help="GPU-hours per stage for a config's data, per node layout, with the "
                               "rates' sources")
    plan.add_argument("path")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    positive = dict(type=positive_int, metavar="N")
    plan.add_argument("--conversations", **positive, help="training conversations (default: the sum of the "
                      "sources' limits; needed when a source has none)")
    plan.add_argument("--answer-tokens", type=positive_int, nargs="+", metavar="T", help="generated tokens per answer, one "
                      "column each (default: data.regenerate.max_tokens, the cap)")
    plan.add_argument("--prompt-tokens", **positive, help="prompt tokens per conversation (default: 1000, assumed)")
    plan.add_argument("--capture-nodes", **positive, help="capture nodes of the split layout (default: as many as "
                      "keep the trainer nodes busy)")
    plan.add_argument("--trainer-nodes", type=positive_int, default=1, metavar="N",
                      help="trainer nodes of the split layout")


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def plan_text(args: argparse.Namespace) -> str:
    """What `plan` prints for these parsed arguments."""
    config = load_config(args.path, args.overrides)
    return render(config, args.path, args.conversations, args.answer_tokens, args.prompt_tokens,
                  args.capture_nodes, args.trainer_nodes)


def print_stages(config: RunConfig | None) -> None:
    """Each stage under its one name (its folder under run_dir): script, module, inputs, outputs; with a config,
    its state in that config's run_dir."""
    for spec in STAGES.values():
        reads = ", ".join(spec.inputs) or "the config's data sources and the target"
        print(f"{spec.name}\n  script   {spec.script}\n  module   {spec.module}\n  reads    {reads}\n"
              f"  writes   {spec.name}/: {spec.writes}")
        if config is not None:
            print(f"  state    {Stage(config, spec.name).state()}")

if __name__ == "__main__":
    sys.exit(main())
