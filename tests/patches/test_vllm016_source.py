"""What the vLLM 0.16 patches and the capture worker rely on, checked in vLLM 0.16.0's real vllm_source.

vLLM 0.16 cannot run on this machine, so its wheel (fetched by `make setup`, pinned by sha256 in
requirements-vllm-source.txt) is read as syntax trees:
every class, method, signature and call the patches assume is an "anchor" below. A renamed method in a
copy of that source must make its anchors fail (`test_a_broken_anchor_is_caught`). Where the installed
vLLM can run the same code, other tests run it for real (test_capture_worker.py, test_cpu_connector.py).

    # other releases too, once requirements-vllm-source.txt pins them and `make setup` fetched them:
    EAGLE3_VLLM_SOURCE_VERSIONS=0.16.0,0.17.0 python -m pytest tests/patches/test_vllm016_source.py
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from tests.patches.vllm_source import Source, body_fingerprint, call_name, calls, parameters

DEEPSEEK = "vllm/model_executor/models/deepseek_v2.py"
KIMI = "vllm/model_executor/models/kimi_k25.py"
LLAMA = "vllm/model_executor/models/llama.py"
INTERFACES = "vllm/model_executor/models/interfaces.py"
REGISTRY = "vllm/model_executor/models/registry.py"
SPECULATIVE = "vllm/config/speculative.py"
PROPOSER = "vllm/v1/spec_decode/eagle.py"
RUNNER = "vllm/v1/worker/gpu_model_runner.py"
WORKER_BASE = "vllm/v1/worker/worker_base.py"

# The statements of vLLM 0.16.0's (and 0.17.0's) DeepseekV2Model.forward, which
# Eagle3DeepseekV2Model.forward re-expresses with the aux capture added. A change upstream means the
# override must be compared with the new body again before this value is updated.
DEEPSEEK_MODEL_FORWARD = "20543de6943eb6f0"

ANCHORS: dict[str, Callable[[Source], None]] = {}


def anchor(patch: str):
    def register(check: Callable[[Source], None]):
        ANCHORS[f"{patch}/{check.__name__}"] = check
        return check

    return register


def assigned_attributes(function: ast.FunctionDef) -> set[str]:
    return {ast.unparse(t) for n in ast.walk(function) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])}


def decorators(node: ast.FunctionDef | ast.ClassDef) -> list[str]:
    return [ast.unparse(d) for d in node.decorator_list]


def returns_call_result_unchanged(function: ast.FunctionDef, callee: str) -> bool:
    """The body is `x = <callee>(...)` then `return x`, or `return <callee>(...)`: no post-processing."""
    statements = [s for s in function.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    last = statements[-1]
    if isinstance(last, ast.Return) and isinstance(last.value, ast.Call):
        return call_name(last.value) == callee
    first = next((s for s in statements if isinstance(s, ast.Assign) and isinstance(s.value, ast.Call)
                  and call_name(s.value) == callee), None)
    return (first is not None and isinstance(last, ast.Return)
            and ast.unparse(last.value) == ast.unparse(first.targets[0]))


# ------------------------------------------------------------------------ vllm-eagle3-deepseek-kimi
@anchor("vllm-eagle3-deepseek-kimi")
def deepseek_model_forward_is_the_one_reexpressed(src: Source):
    model = src.cls(DEEPSEEK, "DeepseekV2Model")
    assert "support_torch_compile" in decorators(model), "DeepseekV2Model is no longer decorated for compilation"
    forward = src.function(DEEPSEEK, "forward", "DeepseekV2Model")
    assert parameters(forward) == "self, input_ids, positions, intermediate_tensors, inputs_embeds=None"
    assert body_fingerprint(forward) == DEEPSEEK_MODEL_FORWARD, "DeepseekV2Model.forward changed upstream"


@anchor("vllm-eagle3-deepseek-kimi")
def deepseek_model_parts_used_by_the_forward(src: Source):
    init = src.function(DEEPSEEK, "__init__", "DeepseekV2Model")
    assert parameters(init) == "self, *, vllm_config, prefix=''"
    assert {"self.config", "self.norm", "(self.start_layer, self.end_layer, self.layers)"} <= assigned_attributes(init)
    assert src.has_function(DEEPSEEK, "embed_input_ids", "DeepseekV2Model")
    scaling = src.function(DEEPSEEK, "_get_llama_4_scaling")
    assert parameters(scaling) == "original_max_position_embeddings, scaling_beta, positions"
    layer_forward = src.function(DEEPSEEK, "forward", "DeepseekV2DecoderLayer")
    assert parameters(layer_forward) == "self, positions, hidden_states, residual, llama_4_scaling=None"


@anchor("vllm-eagle3-deepseek-kimi")
def deepseek_causal_lm_builds_model_cls_and_passes_its_output_on(src: Source):
    lm = src.cls(DEEPSEEK, "DeepseekV2ForCausalLM")
    assert any(isinstance(n, ast.Assign) and ast.unparse(n) == "model_cls = DeepseekV2Model" for n in lm.body), \
        "DeepseekV2ForCausalLM.model_cls is gone"
    init = src.function(DEEPSEEK, "__init__", "DeepseekV2ForCausalLM")
    assert any(call_name(c) == "self.model_cls" for c in calls(init))
    assert returns_call_result_unchanged(src.function(DEEPSEEK, "forward", "DeepseekV2ForCausalLM"), "self.model")
    assert not src.has_function(DEEPSEEK, "set_aux_hidden_state_layers", "DeepseekV2ForCausalLM"), "already native"
    assert [ast.unparse(b) for b in src.cls(DEEPSEEK, "DeepseekV3ForCausalLM").bases] == ["DeepseekV2ForCausalLM"]
    imported = {a.name for n in src.module(DEEPSEEK).body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert {"get_pp_group", "IntermediateTensors", "islice"} <= imported


@anchor("vllm-eagle3-deepseek-kimi")
def kimi_builds_its_language_model_as_deepseek_v2_through_the_registry(src: Source):
    init = src.function(KIMI, "__init__", "KimiK25ForConditionalGeneration")
    assert parameters(init) == "self, vllm_config, prefix=''"
    assert "self.config" in assigned_attributes(init) and "media_placeholder_token_id" in ast.unparse(init)
    build = [c for c in calls(init) if call_name(c) == "init_vllm_registered_model"]
    assert build and "architectures=['DeepseekV2ForCausalLM']" in ast.unparse(build[0])
    assert returns_call_result_unchanged(src.function(KIMI, "forward", "KimiK25ForConditionalGeneration"),
                                         "self.language_model")
    assert not src.has_function(KIMI, "set_aux_hidden_state_layers", "KimiK25ForConditionalGeneration"), "native"


@anchor("vllm-eagle3-deepseek-kimi")
def eagle3_interface(src: Source):
    protocol = src.cls(INTERFACES, "SupportsEagle3")
    assert "runtime_checkable" in decorators(protocol)
    assert ast.unparse(src.function(INTERFACES, "set_aux_hidden_state_layers", "SupportsEagle3").args) == \
        "self, layers: tuple[int, ...]"
    assert ast.unparse(src.function(INTERFACES, "get_eagle3_aux_hidden_state_layers", "SupportsEagle3").returns) == \
        "tuple[int, ...]"
    src.cls(INTERFACES, "SupportsEagle")
    src.function(INTERFACES, "supports_eagle3")


@anchor("vllm-eagle3-deepseek-kimi")
def the_runner_drives_the_interface(src: Source):
    load = ast.unparse(src.function(RUNNER, "load_model", "GPUModelRunner"))
    for used in ("supports_eagle3(self.get_model())", "self.model.get_eagle3_aux_hidden_state_layers()",
                 "self.model.set_aux_hidden_state_layers(aux_layers)"):
        assert used in load, f"GPUModelRunner.load_model no longer calls {used}"


@anchor("vllm-eagle3-deepseek-kimi")
def the_proposer_falls_back_to_image_token_index(src: Source):
    load = src.function(PROPOSER, "load_model", "SpecDecodeBaseProposer")
    assert not src.has_function(PROPOSER, "load_model", "EagleProposer")
    assert "self.model.config.image_token_index = target_model.config.image_token_index" in ast.unparse(load)
    assert "KimiK25ForConditionalGeneration" not in ast.unparse(load), "Kimi is special-cased upstream already"


@anchor("vllm-eagle3-deepseek-kimi")
def the_registry_takes_lazy_replacements(src: Source):
    assert parameters(src.function(REGISTRY, "register_model", "_ModelRegistry")) == "self, model_arch, model_cls"
    src.function(REGISTRY, "get_supported_archs", "_ModelRegistry")
    registered = {n.value for n in ast.walk(src.module(REGISTRY)) if isinstance(n, ast.Constant)}
    assert {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"} <= registered


# ------------------------------------------------------------------------ vllm-eagle3-target-check
@anchor("vllm-eagle3-target-check")
def the_allowlist_is_the_validators_last_check(src: Source):
    config = src.cls(SPECULATIVE, "SpeculativeConfig")
    assert "config" in decorators(config)
    verify = src.function(SPECULATIVE, "_verify_args", "SpeculativeConfig")
    assert "model_validator(mode='after')" in decorators(verify)
    rejects = [i for i, s in enumerate(verify.body)
               if isinstance(s, ast.If) and "is only supported for" in ast.unparse(s)]
    assert len(rejects) == 1, "the EAGLE-3 target allowlist is gone or moved"
    check = verify.body[rejects[0]]
    assert "self.target_model_config.hf_text_config.model_type" in ast.unparse(check.test)
    assert "'eagle3'" in ast.unparse(check.test) and "deepseek" not in ast.unparse(verify)
    assert [ast.unparse(s) for s in verify.body[rejects[0] + 1:]] == \
        ["self.verify_equal_vocab_size_if_draft_model()", "return self"]
    src.function(SPECULATIVE, "verify_equal_vocab_size_if_draft_model", "SpeculativeConfig")


@anchor("vllm-eagle3-target-check")
def configs_are_pydantic_dataclasses(src: Source):
    utils = src.module("vllm/config/utils.py")
    assert any(isinstance(n, ast.ImportFrom) and n.module == "pydantic.dataclasses"
               and "dataclass" in [a.name for a in n.names] for n in utils.body)
    assert "dataclass(cls, config=merged_config" in ast.unparse(src.function("vllm/config/utils.py", "config"))


# ------------------------------------------------------------------------ capture worker (not a patch)
@anchor("capture-worker")
def the_extension_is_mixed_into_the_worker(src: Source):
    assert "worker_class.__bases__ = worker_class.__bases__ + (worker_extension_cls,)" in ast.unparse(
        src.module(WORKER_BASE))
    init = src.function(WORKER_BASE, "__init__", "WorkerBase")
    assert {"self.rank", "self.model_runner"} <= assigned_attributes(init)
    assert parameters(src.function("vllm/entrypoints/llm.py", "collective_rpc", "LLM")).startswith(
        "self, method, timeout=None, args=()")


@anchor("capture-worker")
def the_runner_calls_model_forward_with_keywords(src: Source):
    forward = src.function(RUNNER, "_model_forward", "GPUModelRunner")
    assert parameters(forward) == \
        "self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None, **model_kwargs"
    execute = src.function(RUNNER, "execute_model", "GPUModelRunner")
    call = [c for c in calls(execute) if call_name(c) == "self._model_forward"]
    assert len(call) == 1 and "positions" in [k.arg for k in call[0].keywords]
    assert "hidden_states, aux_hidden_states = model_output" in ast.unparse(execute)
    src.function(RUNNER, "get_model", "GPUModelRunner")


@anchor("capture-worker")
def the_batch_layout_the_worker_reads(src: Source):
    init = assigned_attributes(src.function(RUNNER, "__init__", "GPUModelRunner"))
    assert {"self.input_ids", "self.query_start_loc", "self.input_batch"} <= init
    prepare = ast.unparse(src.function(RUNNER, "_prepare_inputs", "GPUModelRunner"))
    assert "self.query_start_loc.np[1:num_reqs + 1] = cu_num_tokens" in prepare
    assert "self.input_ids.cpu[:total_num_scheduled_tokens]" in prepare
    assert "property" in decorators(src.function("vllm/v1/worker/gpu_input_batch.py", "req_ids", "InputBatch"))


@anchor("capture-worker")
def models_call_the_final_norm_with_the_residual(src: Source):
    for path, model in ((DEEPSEEK, "DeepseekV2Model"), (LLAMA, "LlamaModel")):
        forward = ast.unparse(src.function(path, "forward", model))
        assert "hidden_states, _ = self.norm(hidden_states, residual)" in forward
    assert src.has_function(LLAMA, "set_aux_hidden_state_layers", "LlamaForCausalLM")


@anchor("capture-worker")
def the_engine_settings_it_checks(src: Source):
    fields = {("vllm/config/model.py", "ModelConfig"): "enforce_eager", ("vllm/config/cache.py", "CacheConfig"):
              "enable_prefix_caching", ("vllm/config/parallel.py", "ParallelConfig"): "pipeline_parallel_size",
              ("vllm/config/vllm.py", "VllmConfig"): "speculative_config"}
    for (path, cls), field in fields.items():
        assert any(isinstance(n, ast.AnnAssign) and ast.unparse(n.target) == field for n in src.cls(path, cls).body), \
            f"{cls}.{field} is missing"


# ------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", ANCHORS)
def test_anchor_holds(vllm_source: Source, name: str):
    ANCHORS[name](vllm_source)


# A rename in a copy of the source, and the anchors that must then fail.
BREAKS = {
    "GPUModelRunner._model_forward": (RUNNER, "def _model_forward(", "def _forward_model(",
                                      {"capture-worker/the_runner_calls_model_forward_with_keywords"}),
    "DeepseekV2ForCausalLM.model_cls": (DEEPSEEK, "model_cls", "model_class",
                                        {"vllm-eagle3-deepseek-kimi/deepseek_causal_lm_builds_model_cls_and_passes_its_output_on"}),
    "SpeculativeConfig._verify_args": (SPECULATIVE, "def _verify_args(", "def _check_args(",
                                       {"vllm-eagle3-target-check/the_allowlist_is_the_validators_last_check"}),
}


@pytest.mark.parametrize("renamed", BREAKS)
def test_a_broken_anchor_is_caught(vllm_source: Source, tmp_path, renamed: str):
    path, old, new, must_fail = BREAKS[renamed]
    original = (vllm_source.root / path).read_text()
    assert old in original
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(original.replace(old, new))
    broken = Source(tmp_path, fallback=vllm_source.root)
    failed = set()
    for name, check in ANCHORS.items():
        try:
            check(broken)
        except AssertionError:
            failed.add(name)
    assert failed == must_fail


# ------------------------------------------------------ the patched classes against 0.16's interface
def signature_text(function) -> str:
    """`(self, layers: tuple[int, ...]) -> None` from a live function (string annotations) or an AST."""
    if isinstance(function, ast.FunctionDef):
        return f"({ast.unparse(function.args)}) -> {ast.unparse(function.returns)}"
    signature = inspect.signature(function)
    params = ", ".join(f"{p.name}: {p.annotation}" if p.annotation is not p.empty else p.name
                       for p in signature.parameters.values())
    return f"({params}) -> {signature.return_annotation}"


def test_patched_classes_present_the_016_eagle3_interface(vllm_source: Source):
    from vllm.model_executor.models.interfaces import supports_eagle3

    from patches.vllm_classes import eagle3_deepseek_kimi as classes
    from patches.vllm_eagle3_deepseek_kimi import CLASSES, REPLACEMENTS

    assert classes.__name__ == CLASSES
    for name in REPLACEMENTS.values():
        cls = getattr(classes, name)
        assert supports_eagle3(cls), name
        for method in ("set_aux_hidden_state_layers", "get_eagle3_aux_hidden_state_layers"):
            assert signature_text(getattr(cls, method)) == signature_text(
                vllm_source.function(INTERFACES, method, "SupportsEagle3")), f"{name}.{method}"


def call_shape(function) -> list[tuple[str, str, object]]:
    """(name, positional|keyword, default or "-") per parameter, from a live function or an AST."""
    if isinstance(function, ast.FunctionDef):
        args = function.args
        positional = args.posonlyargs + args.args
        defaults = ["-"] * (len(positional) - len(args.defaults)) + [ast.literal_eval(d) for d in args.defaults]
        keyword = ["-" if d is None else ast.literal_eval(d) for d in args.kw_defaults]
        return ([(a.arg, "positional", d) for a, d in zip(positional, defaults, strict=True)]
                + [(a.arg, "keyword", d) for a, d in zip(args.kwonlyargs, keyword, strict=True)])
    return [(p.name, "keyword" if p.kind is p.KEYWORD_ONLY else "positional",
             "-" if p.default is p.empty else p.default) for p in inspect.signature(function).parameters.values()]


def test_patched_model_keeps_the_016_call_signatures(vllm_source: Source):
    # support_torch_compile reads the dynamic arguments from the upstream forward's signature, and vLLM
    # builds these classes with upstream's keywords.
    from patches.vllm_classes import eagle3_deepseek_kimi as classes

    pairs = ((classes.Eagle3DeepseekV2Model, DEEPSEEK, "DeepseekV2Model"),
             (classes.Eagle3KimiK25ForConditionalGeneration, KIMI, "KimiK25ForConditionalGeneration"))
    for patched, path, upstream in pairs:
        for method in ("__init__", "forward"):
            if method in vars(patched):
                theirs = vllm_source.function(path, method, upstream)
                assert call_shape(getattr(patched, method)) == call_shape(theirs), f"{patched.__name__}.{method}"


def test_interface_methods_behave_like_018():
    from patches.vllm_classes.eagle3_deepseek_kimi import (
        Eagle3DeepseekV2ForCausalLM,
        Eagle3KimiK25ForConditionalGeneration,
    )

    lm = SimpleNamespace(model=SimpleNamespace(layers=[None] * 61, aux_hidden_state_layers=()))
    assert Eagle3DeepseekV2ForCausalLM.get_eagle3_aux_hidden_state_layers(lm) == (2, 30, 58)  # Kimi-K2.5's 61
    Eagle3DeepseekV2ForCausalLM.set_aux_hidden_state_layers(lm, (2, 30, 58))
    assert lm.model.aux_hidden_state_layers == (2, 30, 58)

    kimi = SimpleNamespace(language_model=SimpleNamespace(
        set_aux_hidden_state_layers=lambda layers: setattr(kimi, "got", layers),
        get_eagle3_aux_hidden_state_layers=lambda: (1, 2, 3)))
    Eagle3KimiK25ForConditionalGeneration.set_aux_hidden_state_layers(kimi, (4, 5))
    assert kimi.got == (4, 5)
    assert Eagle3KimiK25ForConditionalGeneration.get_eagle3_aux_hidden_state_layers(kimi) == (1, 2, 3)
