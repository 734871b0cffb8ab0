"""Differences between an export and the spec it must meet, each classified by what vLLM makes of it.

    cosmetic   vLLM reads both the same way (it renames `layers.0.` and `midlayer.`, ignores t2d, bos/eos ids)
    optional   allowed either way (`embed_tokens.weight`: absent = shared from the target)
    breaking   vLLM refuses it, or serves something other than what was trained: a missing, extra or
               renamed tensor, a wrong shape or dtype, a config field that changes the computation, d2t out
               of range or not increasing, d2t and t2d disagreeing, aux ids in another convention

`compare_specs` works on specs alone (names, shapes, dtypes, config); `check_vocab_maps` needs d2t/t2d values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3_pipeline.export.format import Spec, implied_tensors, read_spec, read_tensor, spec_format

BREAKING, OPTIONAL, COSMETIC = "breaking", "optional", "cosmetic"
EMBED = "embed_tokens.weight"

# config fields vLLM does not use to build or run the draft
COSMETIC_FIELDS = {
    "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "transformers_version",
    "speculators_version", "_name_or_path", "initializer_range", "use_cache", "pretraining_tp",
    "attention_dropout", "output_hidden_states", "output_attentions", "return_dict", "id2label", "label2id",
    "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "embed_requires_grad", "mlp_bias",
}
# names vLLM's registry maps to the same class (Eagle3LlamaForCausalLM)
EAGLE3_LLAMA_ARCHITECTURES = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}
# what vLLM assumes when a flag is absent, per format (its speculators reader defaults norm_before_residual on)
FLAG_DEFAULTS = {
    "reference": {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False},
    "speculators": {"norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False},
}
AUX_IDS = "eagle_aux_hidden_state_layer_ids"


@dataclass(frozen=True)
class Difference:
    kind: str  # breaking | optional | cosmetic
    where: str  # "tensor fc.weight", "config head_dim", "d2t"
    message: str

    def to_json(self) -> dict[str, str]:
        return asdict(self)


def ordered(differences: list[Difference]) -> list[Difference]:
    """Breaking first, then optional, then cosmetic; by place within each kind."""
    rank = {BREAKING: 0, OPTIONAL: 1, COSMETIC: 2}
    return sorted(differences, key=lambda d: (rank[d.kind], d.where))


def compare_specs(actual: Spec, expected: Spec, serving_len: int) -> list[Difference]:
    """Every tensor and config difference between `actual` and `expected`, then `actual`'s own consistency."""
    fmt = spec_format(actual.config)
    differences = compare_tensors(actual.tensors, expected.tensors)
    differences += compare_configs(flatten(actual.config), flatten(expected.config), fmt, serving_len)
    reported = {d.where for d in differences}
    differences += [d for d in self_consistency(actual) if d.where not in reported]
    return differences


# ---------------------------------------------------------------------------------------------- tensors
def vllm_name(name: str) -> str:
    """The name vLLM's Eagle-3 loader gives a tensor (it renames `midlayer.` to `layers.0.`)."""
    return name.replace("midlayer.", "layers.0.", 1)


def compare_tensors(actual: dict, expected: dict) -> list[Difference]:
    by_vllm_name = {vllm_name(name): name for name in actual}
    found = {name: name if name in actual else by_vllm_name.get(vllm_name(name)) for name in expected}
    missing = {name: want for name, want in expected.items() if found[name] is None}
    extra = {name: got for name, got in actual.items() if name not in found.values()}
    differences = []
    for name, want in expected.items():
        if found[name] is None:
            differences.append(missing_tensor(name, want, extra))
        else:
            differences += compare_tensor(found[name], name, actual[found[name]], want)
    differences += [extra_tensor(name, got, missing) for name, got in extra.items()]
    return differences


def missing_tensor(name: str, want: dict, extra: dict) -> Difference:
    where = f"tensor {name}"
    if name == EMBED:
        return Difference(OPTIONAL, where, "absent: vLLM shares the target's embedding")
    if name == "t2d":
        return Difference(COSMETIC, where, "absent: vLLM ignores t2d (d2t alone maps draft ids to target ids)")
    if name == "d2t":
        return Difference(BREAKING, where, "missing: vLLM keeps its draft-to-target map at zero, so draft id i "
                                           "proposes target token i")
    if is_norm(name):
        return Difference(BREAKING, where, f"missing {fmt_tensor(want)}: vLLM does not check it and runs the norm "
                                           f"with its initial weight of ones{renamed_hint(want, extra, 'has its shape and dtype')}")
    return Difference(BREAKING, where, f"missing {fmt_tensor(want)}: vLLM leaves the parameter "
                                       f"uninitialised{renamed_hint(want, extra, 'has its shape and dtype')}")


def is_norm(name: str) -> bool:
    """An RMSNorm's weight: `norm.weight`, `midlayer.hidden_norm.weight`, `fc_norm.0.weight`, `input_norm.weight`."""
    return any(part.endswith("norm") for part in name.split(".")[:-1])


def extra_tensor(name: str, got: dict, missing: dict) -> Difference:
    where = f"tensor {name}"
    if name == EMBED:
        return Difference(OPTIONAL, where, "present: vLLM uses it (or shares the target's when identical)")
    if name == "t2d":
        return Difference(COSMETIC, where, "present: vLLM skips t2d when it loads")
    if name == "d2t":
        return Difference(BREAKING, where, f"unexpected {fmt_tensor(got)}: the draft predicts the target's whole "
                                           "vocabulary, where vLLM builds no draft-to-target map, and its loader "
                                           "refuses this tensor")
    return Difference(BREAKING, where, f"unexpected {fmt_tensor(got)}: vLLM's loader has no parameter of this "
                                       f"name and refuses the checkpoint{renamed_hint(got, missing, 'is missing with its shape and dtype')}")


def renamed_hint(entry: dict, others: dict, relation: str) -> str:
    lookalike = [name for name, other in others.items() if other == entry]
    return f"; {lookalike[0]} {relation}: renamed?" if lookalike else ""


def compare_tensor(name: str, spec_name: str, got: dict, want: dict) -> list[Difference]:
    where = f"tensor {name}"
    differences = []
    if name != spec_name:
        differences.append(Difference(COSMETIC, where, f"the spec says {spec_name}: vLLM loads both as {vllm_name(name)}"))
    if list(got["shape"]) != list(want["shape"]):
        transposed = len(want["shape"]) == 2 and list(got["shape"]) == list(reversed(want["shape"]))
        note = ": transposed" if transposed else ""
        differences.append(Difference(BREAKING, where, f"shape {got['shape']}, expected {want['shape']}{note}"))
    if got["dtype"] != want["dtype"]:
        differences.append(Difference(BREAKING, where, f"dtype {got['dtype']}, expected {want['dtype']}"))
    return differences


def fmt_tensor(entry: dict) -> str:
    return f"[{', '.join(map(str, entry['shape']))}] {entry['dtype']}"


# ----------------------------------------------------------------------------------------------- config
def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """{"eagle_config": {"a": 1}} -> {"eagle_config.a": 1}; lists stay values."""
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= flatten(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def compare_configs(actual: dict, expected: dict, fmt: str, serving_len: int) -> list[Difference]:
    differences = []
    for key in sorted(set(actual) | set(expected)):
        got, want = actual.get(key, ABSENT), expected.get(key, ABSENT)
        if got != want:
            differences.append(classify_field(key, got, want, fmt, serving_len))
    return differences


class _Absent:
    def __repr__(self) -> str:
        return "absent"


ABSENT = _Absent()


def classify_field(key: str, got: Any, want: Any, fmt: str, serving_len: int) -> Difference:
    leaf, where = key.rsplit(".", 1)[-1], f"config {key}"
    seen = f"{got!r}, expected {want!r}"
    if leaf in FLAG_DEFAULTS[fmt]:
        default = FLAG_DEFAULTS[fmt][leaf]
        same = (default if got is ABSENT else got) == (default if want is ABSENT else want)
        return Difference(COSMETIC if same else BREAKING, where,
                          f"{seen} (vLLM reads absent as {default})" if same else f"{seen}: changes the draft's computation")
    if leaf == AUX_IDS:
        return aux_ids_difference(where, got, want)
    if leaf == "max_position_embeddings" and isinstance(got, int):
        if got < serving_len:
            return Difference(BREAKING, where, f"{seen}: below the serving max_model_len {serving_len}")
        return Difference(COSMETIC, where, f"{seen}: at least the serving length {serving_len}; rope is unscaled")
    if leaf == "architectures" and got is not ABSENT and want is not ABSENT \
            and set(got) | set(want) <= EAGLE3_LLAMA_ARCHITECTURES:
        return Difference(COSMETIC, where, f"{seen}: vLLM maps both to Eagle3LlamaForCausalLM")
    if leaf in COSMETIC_FIELDS:
        return Difference(COSMETIC, where, f"{seen}: vLLM does not use it for the draft")
    return Difference(BREAKING, where, seen)


def aux_ids_difference(where: str, got: Any, want: Any) -> Difference:
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want) and got:
        shifts = {g - w for g, w in zip(got, want)}
        if len(shifts) == 1:
            shift = shifts.pop()
            return Difference(BREAKING, where, f"{got}, expected {want}: every id shifted by {shift:+d}, another "
                              "layer-id convention (vLLM: id i = the residual stream entering layer i; SGLang and "
                              "SpecForge count one lower); vLLM would feed the draft other layers than it learnt")
    return Difference(BREAKING, where, f"{got!r}, expected {want!r}: the draft would read other target layers")


# ------------------------------------------------------------------------------------------ consistency
def self_consistency(actual: Spec) -> list[Difference]:
    """The export's tensors against the ones its own config.json implies (catches a config edited alone, and a
    norm its flags ask for, such as EAGLE 3.1's `fc_norm.{i}.weight`, missing: vLLM would run it at ones)."""
    try:
        implied = implied_tensors(actual.config, spec_format(actual.config))
    except (KeyError, TypeError, ValueError) as err:
        return [Difference(BREAKING, "config", f"does not describe a draft vLLM can build ({type(err).__name__}: {err})")]
    differences = []
    for name, want in implied.items():
        got = actual.tensors.get(name)
        if got is None and is_norm(name) and vllm_name(name) not in map(vllm_name, actual.tensors):
            differences.append(missing_tensor(name, want, {}))
        elif got is not None and list(got["shape"]) != list(want["shape"]):
            differences.append(Difference(BREAKING, f"tensor {name}", f"shape {got['shape']} does not fit the "
                                          f"export's own config.json, which implies {want['shape']}"))
    return differences


# ------------------------------------------------------------------------------------------- vocab maps
def check_vocab_maps(d2t: torch.Tensor | None, t2d: torch.Tensor | None, target_vocab: int) -> list[Difference]:
    """d2t in range and increasing (target_id = draft_id + d2t[draft_id]), and agreeing with t2d."""
    if d2t is None:
        return []  # reported as a missing tensor
    targets = torch.arange(d2t.numel()) + d2t.long()
    kept = t2d.bool().nonzero().flatten() if t2d is not None else None
    if kept is not None and len(kept) == len(targets) and len(shift := (targets - kept).unique()) == 1 and shift[0]:
        return [Difference(BREAKING, "d2t", f"d2t is off by {int(shift[0]):+d} against t2d: every draft id maps to "
                           f"the target id {int(shift[0]):+d} from the one it was trained for")]
    outside = ((targets < 0) | (targets >= target_vocab)).nonzero().flatten()
    if len(outside):
        i = int(outside[0])
        return [Difference(BREAKING, "d2t", f"{len(outside)} draft ids map outside the target vocab "
                                            f"0..{target_vocab - 1} (first: draft {i} -> target {int(targets[i])})")]
    differences = []
    falling = (targets[1:] <= targets[:-1]).nonzero().flatten()
    if len(falling):
        i = int(falling[0])
        differences.append(Difference(BREAKING, "d2t", f"target ids not strictly increasing: draft {i} -> "
                                      f"{int(targets[i])}, draft {i + 1} -> {int(targets[i + 1])}"))
    if kept is not None and not (len(kept) == len(targets) and torch.equal(kept, targets)):
        unmarked = (~t2d.bool()[targets]).nonzero().flatten()
        first = f" (first: draft {int(unmarked[0])} -> target {int(targets[unmarked[0]])})" if len(unmarked) else ""
        differences.append(Difference(BREAKING, "d2t", f"d2t and t2d disagree: t2d keeps {len(kept)} ids, d2t maps "
                                      f"{len(targets)} draft ids, {len(unmarked)} of them to ids t2d does not keep{first}"))
    return differences


# ------------------------------------------------------------------------------------------- whole check
def static_differences(path: Path, expected: Spec, serving_len: int) -> list[Difference]:
    """An export folder (or spec json) against `expected`; with weights at hand, its d2t/t2d values too."""
    actual = read_spec(path)
    differences = compare_specs(actual, expected, serving_len)
    if Path(path).is_dir() and (Path(path) / "config.json").is_file():
        vocab = flatten(expected.config).get("vocab_size") or flatten(expected.config)["transformer_layer_config.vocab_size"]
        differences += check_vocab_maps(read_tensor(path, "d2t"), read_tensor(path, "t2d"), vocab)
        if spec_format(actual.config) == "speculators":
            differences += vllm_reads_speculators(path)
    return differences


# vLLM 0.34 (transformers_utils/config.py, maybe_override_with_speculators) serves a speculators folder alone only
# when its verifier names a Hub repository; a local verifier is served through --speculative-config
LOCAL_VERIFIER_REFUSAL = "must name a remote model repository"


def vllm_reads_speculators(folder: Path) -> list[Difference]:
    """`vllm serve <folder>` must detect the speculators format: EAGLE-3, and the verifier named inside."""
    from vllm.transformers_utils.config import maybe_override_with_speculators

    try:
        _, _, speculative = maybe_override_with_speculators(str(folder), None, trust_remote_code=False)
    except (ValueError, KeyError, TypeError) as err:
        if LOCAL_VERIFIER_REFUSAL in str(err):  # the folder itself is fine; 05 and 06 print the form vLLM takes
            return [Difference(OPTIONAL, "config speculators_config.verifier.name_or_path",
                               "a local folder: this vLLM serves the draft with the target named and "
                               "--speculative-config (the serving command's form), not `vllm serve <folder>` alone")]
        return [Difference(BREAKING, "config speculators_config", f"vLLM cannot read it: {err}")]
    if speculative is None or speculative.get("method") != "eagle3":
        return [Difference(BREAKING, "config speculators_config", f"vLLM reads speculative config {speculative}, not eagle3")]
    return []
