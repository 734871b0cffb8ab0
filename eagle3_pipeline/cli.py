"""What every numbered script shares: the command line and the mapping of errors to exit codes.

Exit codes: 0 ok, 1 failure (the stage could not do its work), 2 usage or config error.
User mistakes end with one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from eagle3_pipeline.config import ConfigError, RunConfig, load_config
from eagle3_pipeline.stage_io import StageError

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.yaml"


def stage_parser(doc: str | None) -> argparse.ArgumentParser:
    """The arguments every stage takes; a stage adds its own to the returned parser."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="run config YAML (default: %(default)s)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set train.max_steps=100",
    )
    parser.add_argument("--force", action="store_true", help="redo the stage even if it is complete")
    return parser


def run_stage(parser: argparse.ArgumentParser, run: Callable[[RunConfig, argparse.Namespace], object]) -> None:
    """Parse the command line, load the config, run the stage, exit with the contract's code."""
    args = parser.parse_args()  # argparse itself exits 2 on a usage error
    try:
        config = load_config(args.config, args.overrides)
        run(config, args)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)
    except StageError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        sys.exit(130)
    sys.exit(0)
