"""Which draft parameters vLLM loaded from the export: a worker extension that records the draft's loading.

vLLM's default loader checks that every parameter was loaded only when a model's `load_weights` returns the
loaded set; the Eagle-3 Llama draft returns None, so a tensor the export lacks, or one under a name vLLM
drops, leaves its parameter uninitialised without a word. After loading, CPU linear layers even drop their
weights for packed copies, so the values cannot be compared afterwards either.

So the draft's loading itself is recorded. vLLM imports the `worker_extension_cls` module in every worker
before the model loads (`LLM(worker_extension_cls=PROBE)`); importing this module wraps
`Eagle3LlamaForCausalLM.load_weights` to keep, per load, the tensor names it received, the parameters its
`AutoWeightsLoader` reports loaded and all the parameters the draft has. `llm.collective_rpc(REPORT)` returns
that from each worker, plus the parameters vLLM shares from the target instead (embedding, lm_head).
"""

from __future__ import annotations

import functools

PROBE = "eagle3_pipeline.validate.weights_probe.DraftWeightsProbe"
REPORT = "draft_weights_report"

_loads: list[dict] = []  # one entry per draft load in this worker process


def _install_recorder() -> None:
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM
    from vllm.model_executor.models.utils import AutoWeightsLoader

    original = Eagle3LlamaForCausalLM.load_weights
    if getattr(original, "records_loading", False):  # imported twice in one process
        return

    @functools.wraps(original)
    def load_weights(self, weights):
        received, loaded = [], set()
        load_all = AutoWeightsLoader.load_weights

        def recording_load_all(loader, *args, **kwargs):
            result = load_all(loader, *args, **kwargs)
            if loader.module is self:  # the outer loader: names relative to the draft model
                loaded.update(result)
            return result

        def tee(pairs):
            for name, tensor in pairs:
                received.append(name)
                yield name, tensor

        AutoWeightsLoader.load_weights = recording_load_all
        try:
            result = original(self, tee(weights))
        finally:
            AutoWeightsLoader.load_weights = load_all
        _loads.append({"received": received, "loaded": sorted(loaded),
                       "parameters": sorted(name for name, _ in self.named_parameters())})
        return result

    load_weights.records_loading = True
    Eagle3LlamaForCausalLM.load_weights = load_weights


class DraftWeightsProbe:
    """Mixed into vLLM's worker class; its method runs in each worker through `llm.collective_rpc`."""

    def draft_weights_report(self) -> dict:
        drafter = getattr(self.model_runner, "drafter", None)
        model = getattr(drafter, "model", None)
        shared = []
        if model is not None and not getattr(model, "has_own_embed_tokens", True):
            shared.append("model.embed_tokens.weight")
        if model is not None and not getattr(model, "has_own_lm_head", True):
            shared.append("lm_head.weight")
        return {"loads": list(_loads), "shared": shared}


def skipped_parameters(report: dict) -> tuple[list[str], list[str]]:
    """(draft parameters neither loaded nor shared from the target, received tensors vLLM dropped knowingly)."""
    if not report["loads"]:
        return ["<no Eagle-3 Llama draft was loaded: is the export's architecture one vLLM maps to it?>"], []
    load = report["loads"][-1]
    skipped = sorted(set(load["parameters"]) - set(load["loaded"]) - set(report["shared"]))
    ignored = sorted(name for name in load["received"] if name.endswith("t2d"))
    return skipped, ignored


_install_recorder()
