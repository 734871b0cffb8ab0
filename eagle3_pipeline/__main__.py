"""Utility commands beside the numbered stage scripts.

    python -m eagle3_pipeline config configs/demo.yaml [--set train.max_steps=10]   # validate, print resolved
    python -m eagle3_pipeline stand-ins [NAME ...]                                  # build stand-in targets
    python -m eagle3_pipeline stages                                                # the stages, in order
    python -m eagle3_pipeline config-reference                                      # docs/config.md
"""

from __future__ import annotations

import argparse
import sys

import yaml

from eagle3_pipeline.config import ConfigError, load_config
from eagle3_pipeline.config_reference import reference
from eagle3_pipeline.stage_io import STAGES
from eagle3_pipeline.stand_ins import BUILDERS, ensure_stand_in


def main() -> int:
    """The utility command named on the command line; its exit code."""
    parser = argparse.ArgumentParser(prog="python -m eagle3_pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("config", help="validate a run config and print it resolved")
    check.add_argument("path")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    build = commands.add_parser("stand-ins", help="build stand-in targets into the cache")
    build.add_argument("names", nargs="*", metavar="NAME", help=f"any of {', '.join(BUILDERS)} (default: all)")
    commands.add_parser("stages", help="list the stages: script, module, what each reads and writes")
    commands.add_parser("config-reference", help="print docs/config.md: every knob, type, default, description")
    args = parser.parse_args()

    if args.command == "stages":
        print_stages()
        return 0
    if args.command == "config-reference":
        print(reference(), end="")
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
    for name in args.names or BUILDERS:
        print(f"{name}: {ensure_stand_in(name)}")
    return 0


def print_stages() -> None:
    """Each stage under its one name (its folder under run_dir): script, module, inputs, outputs."""
    for spec in STAGES.values():
        reads = ", ".join(spec.inputs) or "the config's data sources and the target"
        print(f"{spec.name}\n  script   {spec.script}\n  module   {spec.module}\n  reads    {reads}\n"
              f"  writes   {spec.name}/: {spec.writes}")

if __name__ == "__main__":
    sys.exit(main())
