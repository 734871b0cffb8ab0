"""A vLLM worker extension that records the target's hidden states for every token it computes (stage 02).

It needs no extraction support in vLLM itself (0.16 has none), GPU or CPU, and works on both of vLLM's
model runners: V1 (the default on 0.16-0.28 for MoE models and on CPU) and Model Runner V2 (the default for
dense models on 0.26, for every model from 0.29).

    from eagle3_pipeline.capture.handover import load_captured
    from eagle3_pipeline.capture.worker import EXTENSION
    llm = LLM(model=target, worker_extension_cls=EXTENSION, enforce_eager=True, enable_prefix_caching=False)
    llm.collective_rpc("set_capture_layers", args=([2, 30, 58],))
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], SamplingParams(max_tokens=1))
    captured = load_captured(outputs, llm.collective_rpc("pop_captured", args=(hand_over_dir,))[0])
    # captured[i]: {"token_ids": [T] int64, "aux_hidden_states": [T, n, H], "final_hidden_state": [T, H]}

- `aux_hidden_states[:, j]` is the residual stream entering layer `layer_ids[j]` (`hidden_states +
  residual`, HF `output_hidden_states[i]`), taken from the model's own EAGLE-3 interface
  (`set_aux_hidden_state_layers`), so it is exactly what vLLM feeds an EAGLE-3 draft. Llama-family
  models have it natively; DeepSeek/Kimi from vLLM 0.18, or on 0.16/0.17 with `patches`' plugin.
- `final_hidden_state` is the last layer's output before the final norm (the norm's input
  `hidden_states + residual`): the training targets are lm_head(norm(final)).
- `enforce_eager=True`: the layer choice is made after the engine has started; a compiled graph would
  not see it (the first forward then fails loudly). `enable_prefix_caching=False`: a cached prefix is
  never computed, so it would have no states.
- States are recorded for the tokens of each forward step in order; a chunked prompt is joined. With
  `max_tokens=1` that is exactly the prompt. Tensor-parallel rank 0 keeps them (the residual stream is
  replicated across ranks); the other ranks return an empty dict. Pipeline parallelism is not supported.
- Hand-over (handover.py; RPC results are not a way to move gigabytes), chosen by `set_capture_layers(...,
  handover=)`: `mapped` (the default on a GPU) copies each step's states into page-locked host slabs the main
  process maps, and `pop_captured` returns where each request's chunks lie; `pageable` (the default on CPU) moves
  them with `.cpu()` into one safetensors file per request.
- A forward hook on the model (both runners call `self.model(...)`) records each step and hands the runner
  the plain hidden states it expects without a draft. Which tokens belong to which request is read from the
  runner's own step batch: V1 keeps it on the runner (`input_batch.req_ids`, `query_start_loc`,
  `input_ids`); Model Runner V2 builds a per-step `InputBatch` in `prepare_inputs` (`req_ids`,
  `query_start_loc_np`, `input_ids`), which the hook keeps for the forward that follows.
  `check_runner_support` checks both before any engine starts; `tests/patches/test_vllm016_source.py` checks
  vLLM 0.16.0's source and `tests/capture/test_worker.py` runs it on the installed vLLM.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import time
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.capture.handover import MappedArena, write_request

EXTENSION = "eagle3_pipeline.capture.worker.HiddenStateCapture"
HANDOVERS = ("auto", "mapped", "pageable")


class HiddenStateCapture:
    """Mixed into vLLM's worker class by `LLM(worker_extension_cls=EXTENSION)`; called via `collective_rpc`."""

    def set_capture_layers(self, layer_ids: list[int], handover: str = "auto") -> str:
        """Record the residual stream entering these layers (ascending ids) plus the final norm's input;
        `handover`: "mapped", "pageable" or "auto" (mapped on a GPU, pageable on CPU).

        Returns what it captures from, for the log: the model class (and its language model's)."""
        if handover not in HANDOVERS:
            raise ValueError(f"handover {handover!r}: expected one of {HANDOVERS}")
        ids = tuple(int(i) for i in layer_ids)
        model = self.model_runner.get_model()
        _check_engine(self.vllm_config, self.model_runner, model, ids)
        model.set_aux_hidden_state_layers(ids)
        if not hasattr(self, "_capture_chunks"):  # first call: hook the model once
            # per request: (first position, token ids, aux, final) on the host, or (where the chunk lies in
            # the mapped slabs,): the main process reads its first position there once the copies have landed
            self._capture_chunks: dict[str, list[tuple]] = {}
            self._capture_final: torch.Tensor | None = None
            self._capture_arena: MappedArena | None = None
            self._capture_batch = StepBatch.follow(self.model_runner)
            self._capture_timer = StepTimer()
            model.register_forward_pre_hook(self._capture_timer.forward_started)
            _language_model(model).model.norm.register_forward_pre_hook(self._capture_norm_input, with_kwargs=True)
            model.register_forward_hook(self._capture_output, with_kwargs=True)
        self._capture_layer_ids = ids
        if handover == "auto":
            handover = "mapped" if torch.device(self.model_runner.device).type == "cuda" else "pageable"
        self._capture_handover = handover
        language_model = _language_model(model)
        inner = "" if language_model is model else f" ({type(language_model).__name__})"
        return f"{type(model).__name__}{inner}: layers {list(ids)} + final norm input"

    @classmethod
    def without_engine(cls, num_aux: int, handover: str, directory: str | None = None) -> HiddenStateCapture:
        """The extension as rank 0's worker holds it after `set_capture_layers`, on the host with no engine around it:
        what tests and bench/handover_read.py drive the recording (`_record_step`) and the hand-over through."""
        capture = cls()
        capture.rank, capture._capture_chunks, capture._capture_timer = 0, {}, StepTimer()
        capture._capture_layer_ids, capture._capture_handover = tuple(range(num_aux)), handover
        capture._capture_arena = MappedArena(pin=False, directory=directory) if handover == "mapped" else None
        return capture

    def pop_captured(self, directory: str) -> dict[str, str | list[dict]]:
        """What was recorded since the last call, by vLLM's internal request id (`load_captured` pairs them with the
        request outputs): where each request's chunks lie in the mapped slabs, or (pageable) the safetensors file
        written into `directory` for it."""
        started = time.perf_counter()
        chunks, self._capture_chunks = self._capture_chunks, {}
        arena = self._capture_arena
        if arena is not None:
            arena.wait()  # every copy into the slabs has landed
            arena.next_round()  # the main process reads this round while the next one fills the other bank
            # a few hundred bytes a request: the RPC's result carries them, no file is written
            captured = {req_id: [spec for (spec,) in parts] for req_id, parts in chunks.items()}
        else:
            Path(directory).mkdir(parents=True, exist_ok=True)
            captured = {req_id: write_request(directory, req_id, parts) for req_id, parts in chunks.items()}
        self._capture_timer.seconds["pop_host"] += time.perf_counter() - started
        return captured

    def capture_seconds(self) -> dict[str, float]:
        """Where the worker's capture time went since the last call (StepTimer), read once its copies have landed
        (after `pop_captured`)."""
        return self._capture_timer.pop()

    # ----------------------------------------------------------------------------------- inside the worker
    def _capture_norm_input(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden_states = args[0]
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        # Computed before the norm runs: vLLM's fused add-norm updates its inputs in place.
        self._capture_final = hidden_states if residual is None else hidden_states + residual

    def _capture_output(self, module: torch.nn.Module, args: tuple, inputs: dict, output: Any):
        final, self._capture_final = self._capture_final, None
        if not isinstance(output, tuple) or final is None:
            raise RuntimeError(
                "hidden-state capture: the model ran without its aux outputs or final-norm hook; it was compiled "
                "before set_capture_layers. Start the engine with enforce_eager=True."
            )
        hidden_states, aux_hidden_states = output
        if len(aux_hidden_states) != len(self._capture_layer_ids):
            raise RuntimeError(f"hidden-state capture: asked for layers {self._capture_layer_ids}, "
                               f"the model returned {len(aux_hidden_states)} aux states")
        batch = self._capture_batch.take()
        if self.rank == 0 and batch is not None:  # None: a dummy step (profiling, data-parallel padding)
            positions = inputs["positions"] if "positions" in inputs else args[1]
            with self._capture_timer.recording(final.device, self._capture_arena):
                self._record_step(batch, aux_hidden_states, final, positions)
        return hidden_states  # what the model runner expects without a draft

    def _record_step(self, batch: tuple[list[str], list[int], torch.Tensor], aux_hidden_states: list[torch.Tensor],
                     final: torch.Tensor, positions: torch.Tensor):
        # Request i owns tokens starts[i]:starts[i + 1]; rows past the last are padding.
        req_ids, starts, input_ids = batch
        num_tokens = starts[-1]
        positions = (positions[0] if positions.dim() > 1 else positions)[:num_tokens]  # M-RoPE: [3, T]
        # Copies: the runner's input buffers are refilled for the next step while the side stream may still read.
        token_ids = input_ids[:num_tokens].to(torch.int64, copy=True)
        aux = [states[:num_tokens] for states in aux_hidden_states]
        if self._capture_handover == "mapped":
            if self._capture_arena is None:
                self._capture_arena = MappedArena(pin=token_ids.is_cuda)
            # the positions travel with the states: reading them here would wait for the forward every step
            step = self._capture_arena.put({"token_ids": token_ids, "positions": positions.to(torch.int64, copy=True),
                                            "aux_hidden_states": torch.stack(aux, dim=1),
                                            "final_hidden_state": final[:num_tokens]})

            def chunk(begin: int, end: int) -> tuple:
                return ({**step, "begin": begin, "end": end},)
        else:
            positions = positions.cpu()
            token_ids, aux, final = token_ids.cpu(), torch.stack(aux, dim=1).cpu(), final[:num_tokens].cpu()

            def chunk(begin: int, end: int) -> tuple:
                return int(positions[begin]), token_ids[begin:end], aux[begin:end], final[begin:end]
        for i, req_id in enumerate(req_ids):
            begin, end = starts[i], starts[i + 1]
            if end > begin:
                self._capture_chunks.setdefault(req_id, []).append(chunk(begin, end))


class StepTimer:
    """The worker's side of a capture's time: host seconds spent recording steps (`record_host`) and handing rounds
    over (`pop_host`); on a GPU also the device seconds of the model's forwards (`forward_device`, from the
    forward's start to the recording) and of the copies out to the mapped slabs (`copy_device`, on their side
    stream, the staging on the compute stream included), from CUDA events read only once a round's copies have
    landed, so timing adds no wait. `steps` counts the forwards."""

    def __init__(self):
        self.seconds: collections.Counter = collections.Counter()
        self.events: list[tuple[str, Any, Any]] = []  # (what, start, end) CUDA event pairs not yet read
        self._forward_start = None

    def forward_started(self, module: torch.nn.Module, args: tuple) -> None:
        self.seconds["steps"] += 1
        self._forward_start = self._event() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    @contextlib.contextmanager
    def recording(self, device: torch.device, arena: MappedArena | None):
        started = time.perf_counter()
        if device.type == "cuda" and self._forward_start is not None:
            self.events.append(("forward_device", self._forward_start, self._event()))
        copies = device.type == "cuda" and arena is not None
        if copies:  # from the forward's end (or the step before's copies) to this step's copies' end
            arena.stream.wait_stream(torch.cuda.current_stream())
            copy_start = self._event(arena.stream)
        yield
        if copies:
            self.events.append(("copy_device", copy_start, self._event(arena.stream)))
        self.seconds["record_host"] += time.perf_counter() - started

    def pop(self) -> dict[str, float]:
        for what, start, end in self.events:
            end.synchronize()  # landed already where pop_captured has waited for the copies
            self.seconds[what] += start.elapsed_time(end) / 1000
        self.events.clear()
        seconds, self.seconds = dict(self.seconds), collections.Counter()
        return seconds

    @staticmethod
    def _event(stream=None):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event


class StepBatch:
    """The requests of the step the model is computing, read from the model runner that runs it:
    (request ids, query start offsets [num_reqs + 1], the step's input token ids).

    V1 keeps the batch on the runner. Model Runner V2 returns a fresh `InputBatch` from `prepare_inputs` for
    each real step (dummy steps make theirs elsewhere); the wrapper keeps it for the forward that follows."""

    def __init__(self, runner):
        self.runner = runner
        self.kind = runner_kind(type(runner))
        self.prepared = None  # Model Runner V2: the InputBatch of the step about to run

    @classmethod
    def follow(cls, runner) -> StepBatch:
        batch = cls(runner)
        if batch.kind == "v2":
            prepare_inputs = runner.prepare_inputs

            @functools.wraps(prepare_inputs)
            def keeping_the_batch(*args, **kwargs):
                batch.prepared = prepare_inputs(*args, **kwargs)
                return batch.prepared

            runner.prepare_inputs = keeping_the_batch
        return batch

    def take(self) -> tuple[list[str], list[int], torch.Tensor] | None:
        if self.kind == "v1":
            runner = self.runner
            req_ids = list(runner.input_batch.req_ids)
            return req_ids, runner.query_start_loc.cpu[: len(req_ids) + 1].tolist(), runner.input_ids.gpu
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            return None
        req_ids = list(prepared.req_ids)
        return req_ids, prepared.query_start_loc_np[: len(req_ids) + 1].tolist(), prepared.input_ids


# What each model runner must have for the capture (read in a step, or wrapped): checked before an engine starts.
RUNNER_ATTRIBUTES = {"v1": ("input_batch", "query_start_loc", "input_ids"), "v2": ("prepare_inputs",)}
INPUT_BATCH_FIELDS = ("req_ids", "query_start_loc_np", "input_ids")


def check_runner_support() -> None:
    """Before an engine starts: each model runner the installed vLLM has provides what `StepBatch` reads
    (V1: attributes its constructor sets; V2: `prepare_inputs` and the fields of its `InputBatch`)."""
    import dataclasses
    import inspect

    problems = []
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner
    except ImportError:  # vLLM 0.34 removed Model Runner V1
        V1Runner = None
    if V1Runner is not None:
        constructor = inspect.getsource(V1Runner.__init__)
        missing = [name for name in RUNNER_ATTRIBUTES["v1"] if f"self.{name} =" not in constructor]
        if missing:
            problems.append(f"V1 GPUModelRunner.__init__ sets no {missing}")
    try:
        from vllm.v1.worker.gpu.input_batch import InputBatch
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    except ImportError:  # a vLLM before Model Runner V2
        V2Runner = None
    if V2Runner is not None:
        fields = {field.name for field in dataclasses.fields(InputBatch)}
        missing = [name for name in RUNNER_ATTRIBUTES["v2"] if not hasattr(V2Runner, name)]
        missing += [f"InputBatch.{name}" for name in INPUT_BATCH_FIELDS if name not in fields]
        if missing:
            problems.append(f"Model Runner V2 lacks {missing}")
    if problems:
        raise RuntimeError("hidden-state capture: this vLLM's model runners changed: " + "; ".join(problems))


def runner_kind(runner_class: type) -> str:
    """"v2" for Model Runner V2 (vllm.v1.worker.gpu.*) and its subclasses (vLLM 0.34's CPU runner), "v1" for the
    V1 runner and its subclasses (the CPU runner before 0.34)."""
    v2 = any(base.__module__.startswith("vllm.v1.worker.gpu.") for base in runner_class.__mro__)
    return "v2" if v2 else "v1"


def _language_model(model: torch.nn.Module) -> torch.nn.Module:
    return model.get_language_model() if hasattr(model, "get_language_model") else model


def _check_engine(vllm_config, runner, model: torch.nn.Module, ids: tuple[int, ...]) -> None:
    from vllm.model_executor.models.interfaces import supports_eagle3

    problems = []
    if not supports_eagle3(model):
        problems.append(f"{type(model).__name__} has no aux hidden states (SupportsEagle3); on vLLM 0.16/0.17 "
                        "DeepSeek/Kimi need the patches plugin (python -m patches)")
    num_layers = len(_language_model(model).model.layers)
    if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= num_layers:
        problems.append(f"layer ids {list(ids)} must be distinct, ascending, in 0..{num_layers - 1}")
    if not vllm_config.model_config.enforce_eager:
        problems.append("start the engine with enforce_eager=True")
    if vllm_config.cache_config.enable_prefix_caching:
        problems.append("start the engine with enable_prefix_caching=False")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        problems.append("pipeline parallelism is not supported (use tensor parallelism)")
    if vllm_config.speculative_config is not None:
        problems.append("the engine already runs a speculative method, which owns the aux hidden states")
    kind = runner_kind(type(runner))
    missing = [name for name in RUNNER_ATTRIBUTES[kind] if not hasattr(runner, name)]
    if missing:
        problems.append(f"the {kind} model runner {type(runner).__name__} lacks {missing}")
    if problems:
        raise RuntimeError("hidden-state capture: " + "; ".join(problems))
