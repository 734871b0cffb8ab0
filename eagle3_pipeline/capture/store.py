"""On-disk format of captured hidden states (stage 02 writes it; stages 04 and the tests read it).

A shard is one safetensors file holding many samples back to back along the token axis:

    aux    [N, n_aux, H]   the residual stream entering each aux layer (vLLM convention)
    final  [N, H]          the last layer's output, before the final norm
    (fp8 only) aux_scale [N, n_aux] and final_scale [N], float32: value = fp8 * scale

`index.json` maps each sample id to (shard, offset, length) so a reader slices one sample without reading
others. Shards are written to a temporary name and renamed, then verified before the index lists them.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_pipeline.stage_io import atomic_path, write_json_atomic

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max
STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "fp8": FP8}
INDEX = "index.json"


@dataclass(frozen=True)
class SampleStates:
    sample_id: str
    aux: torch.Tensor  # [T, n_aux, H]
    final: torch.Tensor  # [T, H]


@dataclass(frozen=True)
class IndexEntry:
    shard: str
    offset: int
    length: int


def quantize_fp8(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 with one float32 scale per vector along the last axis (per token, per layer)."""
    values = values.float()
    scale = values.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    return (values / scale.unsqueeze(-1)).to(FP8), scale


def dequantize_fp8(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.float() * scale.unsqueeze(-1)


def bytes_per_token(num_aux: int, hidden_size: int, dtype: str) -> int:
    """Disk bytes one token costs (tensor data only; the safetensors header is negligible)."""
    vectors = num_aux + 1
    if dtype == "fp8":
        return vectors * (hidden_size + 4)
    return vectors * hidden_size * 2


@dataclass(frozen=True)
class StatesLayout:
    """How 02's states are laid out, as index.json, 02's manifest and stream.json record it (in this field order)."""

    aux_layer_ids: list[int]  # the `aux` columns, in order, numbered by `layer_id_convention`
    final_layer_id: int  # `final`'s id in that numbering: the number of decoder layers
    layer_id_convention: str
    hidden_size: int
    dtype: str  # a STORAGE_DTYPES key

    @property
    def bytes_per_token(self) -> int:
        return bytes_per_token(len(self.aux_layer_ids), self.hidden_size, self.dtype)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, record: dict) -> StatesLayout:
        """The layout in a record that may hold more (index.json also holds the splits and the samples)."""
        return cls(**{field.name: record[field.name] for field in fields(cls)})


def encode_states(samples: list[SampleStates], dtype: str) -> dict[str, torch.Tensor]:
    """The tensors of a shard (or of a stream item) holding `samples` back to back along the token axis."""
    aux = torch.cat([s.aux for s in samples])
    final = torch.cat([s.final for s in samples])
    if dtype == "fp8":
        aux, aux_scale = quantize_fp8(aux)
        final, final_scale = quantize_fp8(final)
        tensors = {"aux": aux, "final": final, "aux_scale": aux_scale, "final_scale": final_scale}
    else:
        tensors = {"aux": aux.to(torch.bfloat16), "final": final.to(torch.bfloat16)}
    return {name: tensor.contiguous() for name, tensor in tensors.items()}


# torch dtype -> the safetensors format's name for it
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", FP8: "F8_E4M3", torch.float32: "F32"}


def safetensors_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """`tensors` and `metadata` in the safetensors format (a little-endian u64 header length, the JSON header padded
    to 8 bytes, the tensors' data), their data copied once: safetensors.torch.save copies it several times (4x
    the time on a 940 MB Kimi-K2.5 pack, bench/stream_items.py)."""
    header: dict = {"__metadata__": metadata}
    offset, data = 0, []
    # the library's order: the widest dtypes first, so each tensor's data starts aligned to its element size
    for name, tensor in sorted(tensors.items(), key=lambda item: (-item[1].element_size(), item[0])):
        raw = tensor.contiguous().view(torch.uint8).reshape(-1).numpy()  # no copy
        header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + raw.nbytes]}
        offset += raw.nbytes
        data.append(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return b"".join([len(text).to_bytes(8, "little"), text, *data])


def decode_rows(tensors: dict[str, torch.Tensor], rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, final) of token rows `rows` in bfloat16, from tensors as `encode_states` made them."""
    aux, final = tensors["aux"][rows], tensors["final"][rows]
    if aux.dtype == FP8:
        aux = dequantize_fp8(aux, tensors["aux_scale"][rows])
        final = dequantize_fp8(final, tensors["final_scale"][rows])
    return aux.to(torch.bfloat16), final.to(torch.bfloat16)


def write_shard(path: Path, samples: list[SampleStates], dtype: str) -> dict[str, IndexEntry]:
    """Write samples into one shard atomically; return their index entries."""
    tensors = encode_states(samples, dtype)
    entries, offset = {}, 0
    for sample in samples:
        entries[sample.sample_id] = IndexEntry(path.name, offset, sample.final.shape[0])
        offset += sample.final.shape[0]
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
    return entries


def check_tensors(tensors: dict[str, torch.Tensor], expected_tokens: int, num_aux: int, hidden_size: int,
                  dtype: str) -> str | None:
    """None when `tensors` hold the expected tokens, shapes and dtype, all finite; else what is wrong."""
    want = {"aux": (expected_tokens, num_aux, hidden_size), "final": (expected_tokens, hidden_size)}
    if dtype == "fp8":
        want |= {"aux_scale": (expected_tokens, num_aux), "final_scale": (expected_tokens,)}
    if set(tensors) != set(want):
        return f"tensors {sorted(tensors)}, expected {sorted(want)}"
    for name, shape in want.items():
        tensor = tensors[name]
        expected_dtype = torch.float32 if name.endswith("_scale") else STORAGE_DTYPES[dtype]
        if tuple(tensor.shape) != shape or tensor.dtype != expected_dtype:
            return f"{name} is {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {expected_dtype}"
        if not all_finite(tensor):
            return f"{name} holds non-finite values"
    return None


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, read from the exponent bits of a bf16 or fp8 tensor: no float32 copy, about
    20x faster on a pack (04 checks each stream item before training on it)."""
    if tensor.numel() == 0:
        return True
    if tensor.dtype == torch.bfloat16:  # inf and NaN: every exponent bit set
        return int((tensor.view(torch.int16) & 0x7F80).max()) != 0x7F80
    if tensor.dtype == FP8:  # e4m3fn has no inf; NaN: every exponent and mantissa bit set
        return int((tensor.view(torch.uint8) & 0x7F).max()) != 0x7F
    return bool(torch.isfinite(tensor).all())


def verify_shard(path: Path, expected_tokens: int, num_aux: int, hidden_size: int, dtype: str) -> str | None:
    """None when the shard is readable with the expected tokens, shapes and dtype; else what is wrong."""
    try:
        tensors = load_file(str(path))
    except Exception as err:  # a truncated or corrupt file raises from the safetensors parser
        return f"{path.name}: unreadable ({err})"
    problem = check_tensors(tensors, expected_tokens, num_aux, hidden_size, dtype)
    return f"{path.name}: {problem}" if problem else None


class HiddenStatesReader:
    """Reads one sample's states from a finished (or partially finished) stage-02 folder."""

    def __init__(self, folder: Path, index: dict[str, IndexEntry]):
        self.folder = folder
        self.index = index
        self._open: dict[str, object] = {}

    def _handle(self, shard: str):
        if shard not in self._open:
            self._open[shard] = safe_open(str(self.folder / shard), "pt")
        return self._open[shard]

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.index

    def get(self, sample_id: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux [T, n_aux, H], final [T, H]) in bfloat16 (fp8 shards are dequantized)."""
        entry = self.index[sample_id]
        f = self._handle(entry.shard)
        rows = slice(entry.offset, entry.offset + entry.length)
        return decode_rows({name: f.get_slice(name) for name in f.keys()}, rows)


def write_index(folder: Path, entries: dict[str, IndexEntry], layout: StatesLayout, splits: dict[str, str]) -> None:
    """index.json: the layout, each sample's split (train or eval), and where each sample's states are."""
    write_json_atomic(folder / INDEX, {**layout.to_json(), "splits": splits,
                                       "samples": {k: asdict(v) for k, v in entries.items()}})


def open_reader(folder: Path) -> tuple[HiddenStatesReader, StatesLayout]:
    """A reader over a stage-02 folder and the layout of its states."""
    index = json.loads((folder / INDEX).read_text())
    entries = {k: IndexEntry(**v) for k, v in index["samples"].items()}
    return HiddenStatesReader(folder, entries), StatesLayout.from_json(index)
