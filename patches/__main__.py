"""`python -m patches [-v]`: every patch in the ledger, its version range and its state in this environment.

The patches are applied in this process exactly as vLLM's plugin and the stages apply them, so the states
shown are the ones a vLLM worker or a training stage would get here.
"""

from __future__ import annotations

import argparse
import textwrap

from patches import enabled
from patches.ledger import all_patches, apply_package
from patches.patch import installed_version


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m patches", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="also print each patch's ledger entry")
    verbose = parser.parse_args().verbose

    patches = all_patches()
    outcomes = {}
    for package in dict.fromkeys(patch.package for patch in patches):
        outcomes.update(apply_package(package, enabled=enabled()))

    for patch in patches:
        result = outcomes[patch.name]
        installed = installed_version(patch.package) or "not installed"
        print(f"{patch.name}  [{patch.package} {patch.versions}; affected {patch.affected}; here {installed}]")
        print(f"    {result.state}: {result.detail}")
        if verbose:
            for label in ("why", "how", "upstream", "remove_when"):
                heading = f"    {label.replace('_', ' ') + ':':<14}"
                text = getattr(patch, label)
                print(textwrap.fill(text, width=110, initial_indent=heading, subsequent_indent=" " * 18))
        print()


if __name__ == "__main__":
    main()
