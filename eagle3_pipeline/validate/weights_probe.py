"""Which draft parameters vLLM loaded from the export: a worker extension that records the draft's loading.

vLLM's default loader checks that every parameter was loaded only when a model's `load_weights` returns the
loaded set; the Eagle-3 Llama draft returns None, so a tensor the export lacks, or one under a name vLLM
drops, leaves its parameter uninitialised without a word. After loading, CPU linear layers even drop their
weights for packed copies, so the values cannot be compared afterwards either.

So the draft's loading itself is recorded. vLLM imports the `worker_extension_cls` module in every worker before the
model loads (06's `worker.WORKER_EXTENSION` mixes this class in); importing this module wraps
`Eagle3LlamaForCausalLM.load_weights` (and `Eagle3DeepseekV2ForCausalLM.load_weights`, the MLA draft) to keep, per
load, the tensor names it received, the parameters its `AutoWeightsLoader` reports loaded and all the parameters the
draft has. `llm.collective_rpc(REPORT)` returns that from each worker, plus the draft parameters that are the
target's own tensors (the embedding, and the lm_head where the draft has none): found by storage, whichever model
runner holds the draft (V1 names it `runner.drafter`, Model Runner V2 `runner.speculator`;
`runner.get_draft_model()` is on both) and whatever flags vLLM set while sharing.

A norm the export's config.json asks for (EAGLE 3.1's `fc_norm`: one per aux state; `norm_before_fc`'s `input_norm`)
is a parameter only where vLLM read the flag, and runs at its initial ones where the tensor is missing:
`flagged_norms` names the parameters vLLM must have loaded for those flags.
"""

from __future__ import annotations

import functools

from eagle3_pipeline.draft_spec import whole_vocabulary
from eagle3_pipeline.export.format import draft_fields

REPORT = "draft_weights_report"

_loads: list[dict] = []  # one entry per draft load in this worker process


def _install_recorder() -> None:
    """Record the loading of vLLM's Eagle-3 Llama draft and, where this vLLM has it, of its MLA draft."""
    from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM

    _record_loading(Eagle3LlamaForCausalLM)
    try:  # draft.attention mla (vLLM 0.18 and later)
        from vllm.model_executor.models.deepseek_eagle3 import Eagle3DeepseekV2ForCausalLM
    except ImportError:
        return
    _record_loading(Eagle3DeepseekV2ForCausalLM)


def _record_loading(draft_class) -> None:
    from vllm.model_executor.models.utils import AutoWeightsLoader

    original = draft_class.load_weights
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
    draft_class.load_weights = load_weights


class DraftWeightsProbe:
    """Mixed into vLLM's worker class; its method runs in each worker through `llm.collective_rpc`."""

    def draft_weights_report(self) -> dict:
        runner = self.model_runner
        draft = runner.get_draft_model()
        if draft is None:
            raise RuntimeError(f"weights probe: {type(runner).__name__}.get_draft_model() found no draft model in "
                               "this engine: it runs no draft-model speculation")
        return {"loads": list(_loads), "shared": shared_parameters(draft, runner.get_model())}


def shared_parameters(draft, target) -> list[str]:
    """The draft's parameters whose storage is one of the target's parameters (shared at load, not loaded)."""
    target_storage = {p.untyped_storage().data_ptr() for p in target.parameters() if p.numel()}
    return sorted(name for name, p in draft.named_parameters(remove_duplicate=False)
                  if p.numel() and p.untyped_storage().data_ptr() in target_storage)


def flagged_norms(config_json: dict) -> list[str]:
    """The vLLM parameter names of the norms an export's config.json turns on (either format)."""
    draft, aux, _ = draft_fields(config_json)
    return ((["model.input_norm.weight"] if draft.norm_before_fc else [])
            + [f"model.fc_norm.{i}.weight" for i in range(len(aux)) if draft.fc_norm])


def left_at_init(config_json: dict) -> list[str]:
    """The vLLM parameters an export rightly leaves to their initial values: the draft-to-target map of a draft over
    the target's whole vocabulary, which vLLM before 0.32 builds for every draft at zeros (the identity, as such a
    draft needs) and 0.32 and later do not build."""
    draft, _, target_vocab = draft_fields(config_json)
    return ["draft_id_to_target_id"] if whole_vocabulary(draft, target_vocab) else []


def loaded_parameters(report: dict) -> list[str]:
    """The draft parameters vLLM's loader filled from the export in its last load (none before a load)."""
    return report["loads"][-1]["loaded"] if report["loads"] else []


def skipped_parameters(report: dict, required: list[str] = (),
                       initialised: list[str] = ()) -> tuple[list[str], list[str]]:
    """(draft parameters neither loaded nor shared from the target, `required` ones (`flagged_norms`) among
    them whether vLLM built them or not, `initialised` ones (`left_at_init`) not; received tensors vLLM dropped
    knowingly)."""
    if not report["loads"]:
        return ["<no Eagle-3 draft was loaded: is the export's architecture one vLLM maps to it?>"], []
    load = report["loads"][-1]
    built = set(load["parameters"]) | set(required)
    skipped = sorted(built - set(loaded_parameters(report)) - set(report["shared"]) - set(initialised))
    ignored = sorted(name for name in load["received"] if name.endswith("t2d"))
    return skipped, ignored


_install_recorder()
