"""A vLLM worker extension that records the target's hidden states for every token it computes (stage 02).

It needs no extraction support in vLLM itself (0.16 has none), GPU or CPU, only the V1 model runner:
the default on 0.16/0.17 and on CPU; set VLLM_USE_V2_MODEL_RUNNER=0 where a release defaults to V2.

    from patches.capture_worker import EXTENSION, load_captured
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
- They are handed over as one safetensors file per request in a directory the caller names (RPC results
  are not a way to move gigabytes, and vLLM's RPC does not return tensors); `load_captured` reads and
  removes them. A local fast disk or /dev/shm suits.
- It relies on vLLM's V1 model runner (`_model_forward`, `input_batch.req_ids`, `query_start_loc`,
  `input_ids`); `tests/patches/test_vllm016_source.py` checks those in vLLM 0.16.0's source and
  `tests/patches/test_capture_worker.py` runs it on the installed vLLM.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

EXTENSION = "patches.capture_worker.HiddenStateCapture"


class HiddenStateCapture:
    """Mixed into vLLM's worker class by `LLM(worker_extension_cls=EXTENSION)`; called via `collective_rpc`."""

    def set_capture_layers(self, layer_ids: list[int]) -> str:
        """Record the residual stream entering these layers (ascending ids) plus the final norm's input.

        Returns what it captures from, for the log: the model class (and its language model's)."""
        ids = tuple(int(i) for i in layer_ids)
        model = self.model_runner.get_model()
        _check_engine(self.vllm_config, self.model_runner, model, ids)
        model.set_aux_hidden_state_layers(ids)
        if not hasattr(self, "_capture_chunks"):  # first call: hook the model once
            self._capture_chunks: dict[str, list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
            self._capture_final: torch.Tensor | None = None
            _language_model(model).model.norm.register_forward_pre_hook(self._capture_norm_input, with_kwargs=True)
            runner = self.model_runner
            runner._model_forward = functools.partial(self._capture_forward, runner._model_forward)
        self._capture_layer_ids = ids
        language_model = _language_model(model)
        inner = "" if language_model is model else f" ({type(language_model).__name__})"
        return f"{type(model).__name__}{inner}: layers {list(ids)} + final norm input"

    def pop_captured(self, directory: str) -> dict[str, str]:
        """Write what was recorded since the last call, one file per request; its path by vLLM's internal
        request id (`load_captured` pairs them with the request outputs)."""
        chunks, self._capture_chunks = self._capture_chunks, {}
        Path(directory).mkdir(parents=True, exist_ok=True)
        paths = {}
        for req_id, parts in chunks.items():
            paths[req_id] = path = os.path.join(directory, f"{req_id}.safetensors")
            save_file(_join(req_id, parts), path + ".tmp")
            os.replace(path + ".tmp", path)  # complete under its final name only
        return paths

    # ----------------------------------------------------------------------------------- inside the worker
    def _capture_norm_input(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden_states = args[0]
        residual = args[1] if len(args) > 1 else kwargs.get("residual")
        # Computed before the norm runs: vLLM's fused add-norm updates its inputs in place.
        self._capture_final = hidden_states if residual is None else hidden_states + residual

    def _capture_forward(self, upstream_forward, *args: Any, **inputs: Any):
        output = upstream_forward(*args, **inputs)
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
        if self.rank == 0:
            self._record_step(aux_hidden_states, final, inputs["positions"])
        return hidden_states  # what the model runner expects without a draft

    def _record_step(self, aux_hidden_states: list[torch.Tensor], final: torch.Tensor, positions: torch.Tensor):
        # The batch is the requests of input_batch in order, request i owning tokens
        # query_start_loc[i]:query_start_loc[i + 1]; rows past the last are padding.
        runner = self.model_runner
        req_ids = list(runner.input_batch.req_ids)
        starts = runner.query_start_loc.cpu[: len(req_ids) + 1].tolist()
        num_tokens = starts[-1]
        token_ids = runner.input_ids.gpu[:num_tokens].to("cpu", torch.int64)
        positions = (positions[0] if positions.dim() > 1 else positions)[:num_tokens].cpu()  # M-RoPE: [3, T]
        aux = torch.stack([states[:num_tokens] for states in aux_hidden_states], dim=1).cpu()
        final = final[:num_tokens].cpu()
        for i, req_id in enumerate(req_ids):
            begin, end = starts[i], starts[i + 1]
            if end > begin:
                part = (int(positions[begin]), token_ids[begin:end], aux[begin:end], final[begin:end])
                self._capture_chunks.setdefault(req_id, []).append(part)


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
    if not hasattr(runner, "_model_forward"):
        problems.append("needs vLLM's V1 model runner (set VLLM_USE_V2_MODEL_RUNNER=0)")
    if problems:
        raise RuntimeError("hidden-state capture: " + "; ".join(problems))


def _join(req_id: str, parts: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One request's chunks in order. A chunk starting at an earlier position replaces what followed it
    (vLLM recomputes a preempted request from its start)."""
    token_ids, aux, final = parts[0][1][:0], parts[0][2][:0], parts[0][3][:0]
    for start, chunk_tokens, chunk_aux, chunk_final in parts:
        if start > len(token_ids):
            raise RuntimeError(f"request {req_id}: tokens {len(token_ids)}..{start - 1} were never computed "
                               "(a prefix-cache hit?)")
        token_ids = torch.cat([token_ids[:start], chunk_tokens])
        aux = torch.cat([aux[:start], chunk_aux])
        final = torch.cat([final[:start], chunk_final])
    return {"token_ids": token_ids, "aux_hidden_states": aux.contiguous(), "final_hidden_state": final.contiguous()}


def load_captured(outputs: list, paths: dict[str, str]) -> list[dict[str, torch.Tensor]]:
    """The states of each `RequestOutput`, in the order of `outputs`, cut to its prompt; the files are removed.

    vLLM's worker sees internal request ids: the output's `request_id`, or it plus "-" and a random suffix.
    Each capture must start with the prompt's tokens: that is checked, not assumed.
    """
    matched = []
    for output in outputs:
        keys = [key for key in paths if key == output.request_id or key.startswith(output.request_id + "-")]
        if len(keys) != 1:
            raise KeyError(f"request {output.request_id}: {len(keys)} captures match (of {len(paths)})")
        states, prompt = load_file(paths[keys[0]]), list(output.prompt_token_ids)
        if states["token_ids"][: len(prompt)].tolist() != prompt:
            raise ValueError(f"request {output.request_id}: captured tokens are not its prompt")
        matched.append({name: tensor[: len(prompt)] for name, tensor in states.items()})
        os.remove(paths[keys[0]])
    return matched
