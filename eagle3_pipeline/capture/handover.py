"""Stage 02: how the capture worker (worker.py) hands the recorded states over to the main process.

RPC results are not a way to move gigabytes, and vLLM's RPC does not return tensors. The worker's
`set_capture_layers(..., handover=)` chooses one of two hand-overs:

- `mapped` (the default on a GPU): each step's states are copied, asynchronously on a side CUDA stream so
  the copy overlaps the next step's forward, into reused page-locked host slabs (`MappedArena`): files in a
  folder of the worker's own (under /dev/shm where it has room), registered with CUDA, so the GPU writes them
  by DMA and the main process maps the same pages; one pass over the bytes. `pop_captured` waits for the
  copies, then returns where each request's chunks lie (no file: a few hundred bytes a request). Two banks of
  slabs take turns, one per `pop_captured`: `load_captured` (which copies the states out) may run while the next
  `generate` fills the other bank, and must end before the `generate` after that (engine.py's capturers overlap
  them so).
- `pageable` (the default on CPU): `.cpu()` per step, then `pop_captured` writes one safetensors file per request
  (`write_request`) into a directory the caller names (a local fast disk or /dev/shm suits), and
  `load_captured` removes each file it read.
"""

from __future__ import annotations

import collections
import functools
import os
import shutil
import tempfile
import weakref
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SLAB_BYTES = 4 << 30  # a mapped slab's size, at least (a step larger than this gets a slab of its own size)
CPU_SLAB_BYTES = 256 << 20  # the same without a GPU (tests: small steps, maybe a small temp disk)
ALIGN = 4096
BLOCK_BYTES = 8 << 20  # the reader copies a step out of its slab in blocks of about this size (StepCopy)
ORPHAN_PREFIX = "capture-handover-"  # + the worker's pid
STATE_NAMES = ("token_ids", "aux_hidden_states", "final_hidden_state")


class MappedArena:
    """Reused host slabs that steps' states are copied into: files in a private folder (under /dev/shm where
    it has room for two slabs, else the temp dir) mapped shared, page-locked with CUDA when `pin`, so a
    device-to-host copy lands in pages the main process maps. Copies run on a side stream; `wait` blocks
    until they have landed. The slabs form two banks: `next_round` starts writing into the other one, so the
    round before stays readable while the next one is written."""

    def __init__(self, pin: bool, directory: str | None = None):
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        for parent in {directory, shm, tempfile.gettempdir()} - {None}:
            _remove_orphans(parent)
        self.slab_bytes = SLAB_BYTES if pin else CPU_SLAB_BYTES
        if directory is None and shm and shutil.disk_usage(shm).free > 2 * self.slab_bytes:
            directory = shm
        self.directory = tempfile.mkdtemp(prefix=f"{ORPHAN_PREFIX}{os.getpid()}-", dir=directory)
        self.pin = pin
        self.mapped: dict[str, torch.Tensor] = {}  # every slab by path, unregistered and released with the arena
        self._cleanup = weakref.finalize(self, _release, self.directory, self.mapped, pin)
        # each bank's first slab at once (the arena is made at the first captured step, the warm-up's): page-locking
        # 4 GB takes about a second, which would otherwise fall in the first batch that writes into the second bank
        self.banks = tuple([self._new_slab(bank, 0, self.slab_bytes)] for bank in (0, 1))
        self.bank, self.slab, self.used = 0, 0, 0
        self.stream = torch.cuda.Stream() if pin else None

    def put(self, tensors: dict[str, torch.Tensor]) -> dict:
        """Start copying one step's tensors (rows = tokens) into a slab; where they will be (`read_step`)."""
        sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in tensors.items()}
        path, base, slab = self._take(sum(_aligned(size) for size in sizes.values()))
        layout, views = {}, []
        for name, tensor in tensors.items():
            layout[name] = [base, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)]
            views.append(slab[base : base + sizes[name]].view(tensor.dtype).view(tensor.shape))
            base += _aligned(sizes[name])
        if self.stream is None:
            for view, tensor in zip(views, tensors.values()):
                view.copy_(tensor)
        else:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for view, tensor in zip(views, tensors.values()):
                    view.copy_(tensor, non_blocking=True)
            for tensor in tensors.values():
                tensor.record_stream(self.stream)  # not reused by the forward before the copy has read it
        return {"slab": path, "tensors": layout}

    def wait(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def next_round(self) -> None:
        """Write from the first slab of the other bank (what it held two rounds ago has been copied out)."""
        self.bank, self.slab, self.used = 1 - self.bank, 0, 0

    def _take(self, nbytes: int) -> tuple[str, int, torch.Tensor]:
        slabs = self.banks[self.bank]
        while self.slab < len(slabs) and self.used + nbytes > slabs[self.slab][1].numel():
            self.slab, self.used = self.slab + 1, 0
        if self.slab == len(slabs):
            slabs.append(self._new_slab(self.bank, len(slabs), max(nbytes, self.slab_bytes)))
        path, slab = slabs[self.slab]
        base, self.used = self.used, self.used + nbytes
        return path, base, slab

    def _new_slab(self, bank: int, index: int, nbytes: int) -> tuple[str, torch.Tensor]:
        path = os.path.join(self.directory, f"bank{bank}-slab{index}.bin")
        if shutil.disk_usage(self.directory).free < nbytes:  # a mapping past a full tmpfs would fault later
            raise RuntimeError(f"hidden-state capture: {self.directory} has no room for another {nbytes}-byte "
                               "slab (one generate call's states must fit); capture fewer prompts at once")
        slab = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        if self.pin:
            status = torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), nbytes, 0)
            if int(status) != 0:
                raise RuntimeError(f"hidden-state capture: page-locking a {nbytes}-byte slab failed (CUDA error "
                                   f"{int(status)}); set_capture_layers(..., handover='pageable') avoids it")
        self.mapped[path] = slab
        return path, slab


def _remove_orphans(parent: str) -> None:
    """Slab folders of workers that died without cleaning up (killed runs): their memory is freed here."""
    for folder in Path(parent).glob(f"{ORPHAN_PREFIX}*-*"):
        pid = folder.name.removeprefix(ORPHAN_PREFIX).split("-")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(folder, ignore_errors=True)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _release(directory: str, slabs: dict[str, torch.Tensor], pin: bool) -> None:
    if pin:
        for slab in slabs.values():
            torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())
    slabs.clear()
    shutil.rmtree(directory, ignore_errors=True)


def read_step(spec: dict, slabs: dict[str, torch.Tensor], rows: slice) -> dict[str, torch.Tensor]:
    """Rows `rows` of the tensors of a step `MappedArena.put` described: views of the mapped slab (`slabs`
    keeps the mappings by path, so a slab's pages are mapped into this process once)."""
    if spec["slab"] not in slabs:
        size = os.path.getsize(spec["slab"])
        slabs[spec["slab"]] = torch.from_file(spec["slab"], shared=True, size=size, dtype=torch.uint8)
    slab, views = slabs[spec["slab"]], {}
    for name, (offset, dtype, shape) in spec["tensors"].items():
        dtype = getattr(torch, dtype)
        nbytes = dtype.itemsize * functools.reduce(int.__mul__, shape, 1)
        views[name] = slab[offset : offset + nbytes].view(dtype).view(shape)[rows]
    return views


def write_request(directory: str, req_id: str, parts: list[tuple]) -> str:
    """One request's chunks, as the pageable hand-over recorded them, joined into one safetensors file in
    `directory`. Returns the file's path."""
    path = os.path.join(directory, f"{req_id}.safetensors")
    save_file(_join(req_id, parts), path + ".tmp")
    os.replace(path + ".tmp", path)  # complete under its final name only
    return path


def _join(req_id: str, parts: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One request's chunks in order. A chunk starting at an earlier position replaces what followed it
    (vLLM recomputes a preempted request from its start)."""
    if len(parts) == 1 and parts[0][0] == 0:  # computed in one step: its chunk (host memory of its own) as it is
        return dict(zip(STATE_NAMES, parts[0][1:]))
    token_ids, aux, final = parts[0][1][:0], parts[0][2][:0], parts[0][3][:0]
    for start, chunk_tokens, chunk_aux, chunk_final in parts:
        if start > len(token_ids):
            raise RuntimeError(f"request {req_id}: tokens {len(token_ids)}..{start - 1} were never computed "
                               "(a prefix-cache hit?)")
        token_ids = torch.cat([token_ids[:start], chunk_tokens])
        aux = torch.cat([aux[:start], chunk_aux])
        final = torch.cat([final[:start], chunk_final])
    return dict(zip(STATE_NAMES, (token_ids, aux.contiguous(), final.contiguous())))


def load_captured(outputs: list, captured: dict[str, str | list[dict]],
                  slabs: dict[str, torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
    """The states of each `RequestOutput`, in the order of `outputs`, cut to its prompt, from what `pop_captured`
    returned; the pageable hand-over's files are removed. `slabs`: the mapped slabs' mappings, kept from one call to
    the next by a caller that reads many rounds.

    vLLM's worker sees internal request ids: the output's `request_id`, or it plus "-" and a random suffix.
    Each capture must start with the prompt's tokens: that is checked, not assumed.
    """
    slabs = {} if slabs is None else slabs
    steps: dict[tuple, StepCopy] = {}  # the steps read so far, by where each lies
    keys_of = collections.defaultdict(list)  # an output's request id -> the internal ids it may have
    for key in captured:
        keys_of[key].append(key)
        if "-" in key:
            keys_of[key.rsplit("-", 1)[0]].append(key)
    matched = []
    for output in outputs:
        keys = keys_of.get(output.request_id, [])
        if len(keys) != 1:
            raise KeyError(f"request {output.request_id}: {len(keys)} captures match (of {len(captured)})")
        where = captured[keys[0]]
        states = load_file(where) if isinstance(where, str) else _mapped(keys[0], where, slabs, steps)
        prompt = list(output.prompt_token_ids)
        if states["token_ids"][: len(prompt)].tolist() != prompt:
            raise ValueError(f"request {output.request_id}: captured tokens are not its prompt")
        matched.append({name: tensor[: len(prompt)] for name, tensor in states.items()})
        if isinstance(where, str):
            os.remove(where)
    return matched


def _mapped(req_id: str, chunks: list[dict], slabs: dict[str, torch.Tensor], steps: dict[tuple, StepCopy]) -> dict:
    """One request's states from its chunks in the mapped slabs, in host memory of their own."""
    parts = []
    for chunk in chunks:
        where = (chunk["slab"], chunk["tensors"]["token_ids"][0])
        if where not in steps:
            steps[where] = StepCopy(read_step(chunk, slabs, slice(None)))
        step = steps[where]
        parts.append((step.positions[chunk["begin"]], *step.rows(chunk["begin"], chunk["end"])))
    return _join(req_id, parts)


class StepCopy:
    """A step's states in its slab, copied out in blocks of about BLOCK_BYTES as its requests are read; a request's
    rows are a view of their block, or a copy of their own where they span a block boundary (every request of a
    block's size or more does)

    Why blocks: each torch call gives up the GIL and must win it back from the main thread, which runs `generate`
    meanwhile, so a copy per request and tensor made this read several times slower beside the engine than alone
    (bench/handover_read.py); and blocks much larger than this would be fresh pages from the system each time, to
    fault in, where freed blocks of this size are reused by the allocator."""

    def __init__(self, views: dict[str, torch.Tensor]):
        self.views = views
        self.positions: list[int] = views["positions"].tolist()
        row_bytes = sum(views[name][0].numel() * views[name].element_size() for name in STATE_NAMES)
        self.block_rows = max(1, BLOCK_BYTES // row_bytes)
        self.blocks: dict[int, list[torch.Tensor]] = {}

    def rows(self, begin: int, end: int) -> list[torch.Tensor]:
        """Rows begin:end of each of STATE_NAMES."""
        block = begin // self.block_rows
        if block != (end - 1) // self.block_rows:  # a block's worth or more (Kimi's long prompts), or across two
            return [self.views[name][begin:end].clone() for name in STATE_NAMES]
        offset = block * self.block_rows
        if block not in self.blocks:
            self.blocks[block] = [self.views[name][offset : offset + self.block_rows].clone() for name in STATE_NAMES]
        return [tensor[begin - offset : end - offset] for tensor in self.blocks[block]]
