"""Every stage: the config keys a stage's code reads, recorded while it runs, to check its fingerprint against.

With `EAGLE3_CONFIG_READS_DIR` set, `load_config` makes every section of the config it returns note each knob
read from it (`config_sections.Section.__getattribute__` calls `note` while `RECORDING`); at exit the dotted
keys go to `<dir>/<script name>.json`. tests/stage_reads.py compares them with each stage's declared
fingerprint (`stage_io.STAGES`): a key a stage reads is part of what makes its output, so a changed value must
make the stage incomplete.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from pathlib import Path
from typing import Any

ENVIRONMENT = "EAGLE3_CONFIG_READS_DIR"
_paths: dict[int, str] = {}  # id(section) -> its dotted path in the run config ("" for the top level)
_sections: list[Any] = []  # the recorded sections, kept alive so their ids stay theirs
_containers: set[str] = set()  # dotted keys that hold sections: reaching into them is no read of a knob
_reads: set[str] = set()
RECORDING = False  # set once `record_if_requested` starts recording: Section reads test it before calling `note`


def note(section: Any, name: str) -> None:
    """`section.name` was read while `RECORDING`: a knob of a recorded config becomes a dotted key."""
    if name not in type(section).model_fields:
        return
    path = _paths.get(id(section))
    if path is not None:
        field = type(section).model_fields[name]
        key = f"{path}.{field.alias or name}".lstrip(".")
        if key not in _containers:
            _reads.add(key)


def record_if_requested(config: Any) -> None:
    """Record the reads of `config` when the environment asks for it."""
    global RECORDING
    folder = os.environ.get(ENVIRONMENT)
    if not folder:
        return
    if not RECORDING:
        RECORDING = True
        atexit.register(_write, Path(folder) / f"{Path(sys.argv[0]).stem}.json")
    _walk(config, "")


def _walk(section: Any, path: str) -> None:
    from pydantic import BaseModel

    from eagle3_pipeline.config_sections import nested_models  # config_sections imports this module

    _paths[id(section)] = path
    _sections.append(section)
    for name, field in type(section).model_fields.items():
        value = section.__dict__.get(name)  # not a read
        key = f"{path}.{field.alias or name}".lstrip(".")
        if nested_models(field.annotation):
            _containers.add(key)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, BaseModel):
                _walk(item, key)


def _write(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sorted(_reads), indent=1))
