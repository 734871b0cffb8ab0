"""The config keys a stage's code reads, recorded while its script runs, to check its fingerprint against.

Installed in a script's process by the `sitecustomize.py` of tests/subprocess_site.py (`reads_dir`), never by the
package itself: `install` makes every section of each config `load_config` returns note each knob read from it
(a wrapper around `Section.__getattribute__`); at exit the dotted keys go to `<dir>/<script name>.json`.
tests/stage_reads.py compares them with each stage's declared fingerprint (`stage_io.STAGES`): a key a stage
reads is part of what makes its output, so a changed value must make the stage incomplete.
"""

from __future__ import annotations

import atexit
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from eagle3_pipeline import config
from eagle3_pipeline.config_sections import Section, nested_models

_paths: dict[int, str] = {}  # id(section) -> its dotted path in the run config ("" for the top level)
_sections: list[Any] = []  # the recorded sections, kept alive so their ids stay theirs
_containers: set[str] = set()  # dotted keys that hold sections: reaching into them is no read of a knob
_knobs: set[str] = set()  # every dotted key of a knob (not a section) of the recorded configs
_reads: set[str] = set()
DUMPS = ("model_dump", "model_dump_json")  # a section dumped is each of its knobs read


def install(folder: str) -> None:
    """Record the reads of every config this process loads; write them at exit."""
    load_config = config.load_config

    def recorded_load_config(*args, **kwargs):
        loaded = load_config(*args, **kwargs)
        _walk(loaded, "")
        return loaded

    def recorded_getattribute(section: Section, name: str) -> Any:
        _note(section, name)
        return BaseModel.__getattribute__(section, name)

    config.load_config = recorded_load_config
    Section.__getattribute__ = recorded_getattribute
    atexit.register(_write, Path(folder) / f"{Path(sys.argv[0]).stem}.json")


def _note(section: Any, name: str) -> None:
    """`section.name` was read: a knob of a recorded config becomes a dotted key. Dumping a section reads all
    its knobs, but for the whole config: that is the manifest's record of it (stage_io.py), no knob's read."""
    fields = type(section).model_fields
    path = _paths.get(id(section))
    if name in DUMPS and path:
        _reads.update(key for key in _knobs if key.startswith(path + "."))
    if name in fields and path is not None:
        key = f"{path}.{fields[name].alias or name}".lstrip(".")
        if key not in _containers:
            _reads.add(key)


def _walk(section: Any, path: str) -> None:
    _paths[id(section)] = path
    _sections.append(section)
    for name, field in type(section).model_fields.items():
        value = section.__dict__.get(name)  # not a read
        key = f"{path}.{field.alias or name}".lstrip(".")
        if nested_models(field.annotation):
            _containers.add(key)
        else:
            _knobs.add(key)
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, BaseModel):
                _walk(item, key)


def _write(path: Path) -> None:
    if _paths:  # a process that loaded a config (not, say, one of vLLM's engine processes)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(sorted(_reads), indent=1))
