"""Stage 05: a trained checkpoint as a draft folder vLLM serves, per format, with a model card and a spec.

    05_export/reference/     config.json (LlamaForCausalLMEagle3, the AQ-MedAI reference's fields),
                             model.safetensors (midlayer.*, fc, norm, lm_head, d2t, t2d; bf16; no embed_tokens)
    05_export/speculators/   config.json with `speculators_config` (verifier, proposal, speculative tokens),
                             model.safetensors (the same tensors under the checkpoint's layers.0.* names)
    each also                README.md (model card), spec.json (config + every tensor's shape and dtype)

`--spec-only` writes one spec.json from the config alone (the draft built on the meta device, no stage read):
the production Kimi shapes, checked on any machine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3_pipeline.acceptance import metric_key, overall_ks
from eagle3_pipeline.config import RunConfig
from eagle3_pipeline.draft_spec import attention_summary, stored_tensors
from eagle3_pipeline.export.format import (
    SPEC_FILE,
    WEIGHTS_FILE,
    Spec,
    draft_fields,
    draft_tensor_shapes,
    export_dtype,
    export_state_dict,
    fold_aux_scale,
    implied_tensors,
    read_spec,
    reference_config,
    run_reference_config,
)
from eagle3_pipeline.export.serving import serving_command, serving_note
from eagle3_pipeline.stage_io import Stage, StageError, read_manifest, write_json_atomic
from eagle3_pipeline.target import architectures, serving_path, target_facts
from eagle3_pipeline.train.checkpoint import step_dirs
from eagle3_pipeline.train.draft_model import build_draft
from eagle3_pipeline.train.metrics import eval_summary


def run(config: RunConfig, force: bool = False, checkpoint: str | None = None) -> None:
    """Stage 05: the last checkpoint (or `checkpoint`) as one draft folder per `export.formats`."""
    stage = Stage(config, "05_export", force=force)
    train_dir = stage.input_dir("04_train")
    step_dir = choose_checkpoint(train_dir, checkpoint)
    refuse_other_checkpoint(stage, step_dir, force)
    if stage.is_complete():
        return
    stage.begin()

    # The draft config as trained: 04 records the aux layer ids of the hidden states it learnt from.
    facts = target_facts(config)
    trained = read_manifest(train_dir)
    reference = reference_config(config.draft, facts, trained["aux_layer_ids"], config.target.engine.max_model_len)
    print(f"05_export: {step_dir} -> {stage.dir} as {', '.join(config.export.formats)}; aux layers "
          f"{trained['aux_layer_ids']} (vLLM convention), draft vocab {config.draft.draft_vocab_size} of {facts['vocab_size']}")
    with stage.timed("load"):
        state = load_checkpoint_state(step_dir, reference)
    metrics = eval_metrics(train_dir, int(step_dir.name.removeprefix("step_")))
    card = model_card_facts(config, step_dir, metrics, facts, stage.input_dir("01_data"))

    for fmt in config.export.formats:
        with stage.timed(fmt):
            folder = write_export(stage, fmt, state, export_config(config, reference, fmt), card)
        print(f"05_export: {fmt:<11} {folder} ({sum(f.stat().st_size for f in folder.iterdir()) / 2**20:.1f} MiB)")
    served = stage.path(config.export.formats[0])
    note = serving_note(config, served)
    print("serve it with:\n  " + serving_command(config, served) + (f"\n  ({note})" if note else ""))
    # What 06 checks each folder against: the spec the config implies (06 cannot build speculators' config)
    specs = {fmt: run_spec(config, fmt).to_json() for fmt in config.export.formats}
    stage.finish(
        counts={"tensors": len(export_state_dict(state, "reference")), "parameters": parameter_count(state)},
        extra={"checkpoint": str(step_dir.relative_to(config.run_dir)), "eval_metrics": metrics,
               "aux_layer_ids": trained["aux_layer_ids"], "formats": list(config.export.formats), "specs": specs},
    )


def write_spec_only(config: RunConfig, out: Path | None) -> Path:
    """spec.json of the first configured format from the config alone (no weights, no earlier stage)."""
    fmt = config.export.formats[0]
    out = out or Path(config.run_dir) / "05_export" / SPEC_FILE
    write_json_atomic(out, run_spec(config, fmt).to_json())
    print(f"05_export: {fmt} spec from {attention_summary(config.draft)}, hidden {config.draft.hidden_size}, "
          f"draft vocab {config.draft.draft_vocab_size} -> {out}")
    return out


# ---------------------------------------------------------------------------------------------- inputs
def choose_checkpoint(train_dir: Path, name: str | None) -> Path:
    """`name` (step_N or N) under 04_train/checkpoints, or the last one."""
    found = step_dirs(train_dir / "checkpoints")
    if not found:
        raise StageError(f"{train_dir}/checkpoints holds no complete checkpoint: run 04_train.py first")
    if name is None:
        return found[-1]
    wanted = name if name.startswith("step_") else f"step_{name}"
    for step_dir in found:
        if step_dir.name == wanted:
            return step_dir
    raise StageError(f"--checkpoint {name}: not in {train_dir}/checkpoints (have: {', '.join(p.name for p in found)})")


def refuse_other_checkpoint(stage: Stage, step_dir: Path, force: bool) -> None:
    done = read_manifest(stage.dir)
    if done and not force and done.get("checkpoint") != str(step_dir.relative_to(stage.run_dir)):
        raise StageError(f"{stage.dir} holds the export of {done.get('checkpoint')}; add --force to replace it "
                         f"with {step_dir.name}")


def load_checkpoint_state(step_dir: Path, reference: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (aux scales folded into fc.weight), checked name by name and shape by shape
    against the draft the config builds."""
    state = load_file(str(step_dir / WEIGHTS_FILE))
    state = fold_aux_scale(state)
    built = stored_tensors({name: shape for name, (shape, _) in draft_tensor_shapes(reference).items()})
    wrong = sorted(set(built) ^ set(state)) + [
        f"{n} {list(state[n].shape)} != {shape}" for n, shape in built.items() if n in state and list(state[n].shape) != shape]
    if wrong:
        raise StageError(f"{step_dir} does not fit the `draft:` config ({len(wrong)} problems, first: {wrong[0]}): "
                         "export with the config it was trained under")
    return state


def eval_metrics(train_dir: Path, step: int) -> dict | None:
    """04's eval summary (train/metrics.py) of its eval record at `step` (metrics.jsonl), or None."""
    records = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    at_step = [r for r in records if r["split"] == "eval" and r["step"] == step]
    return {"step": step, **eval_summary(at_step[-1])} if at_step else None


def parameter_count(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() for t in state.values() if t.is_floating_point())


# --------------------------------------------------------------------------------------------- outputs
def run_spec(config: RunConfig, fmt: str) -> Spec:
    """The spec the run config implies for one export format."""
    reference = run_reference_config(config)
    return Spec(export_config(config, reference, fmt), implied_tensors(reference, fmt))


def speculators_config(reference: dict, verifier: str, verifier_architectures: list[str], k: int) -> dict:
    """The speculators 0.9 config (`vllm serve <dir>` reads verifier and proposal from it) for the same draft."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    model = meta_draft(reference)
    model.config.speculators_config = SpeculatorsConfig(
        algorithm="eagle3",
        proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=k)],
        default_proposal_method="greedy",
        verifier=VerifierConfig(name_or_path=verifier, architectures=verifier_architectures),
    )
    config = model.config.to_dict()
    layer = config["transformer_layer_config"]
    layer.update(bos_token_id=reference["bos_token_id"], eos_token_id=reference["eos_token_id"])
    layer.pop("transformers_version", None)
    for noise in ("_name_or_path", "transformers_version", "id2label", "label2id"):
        config.pop(noise, None)
    config["torch_dtype"] = "bfloat16"
    return config


def meta_draft(config_json: dict):
    """The training draft for a config.json, built on the meta device: shapes without memory or weights."""
    draft, aux, vocab = draft_fields(config_json)
    with torch.device("meta"):
        return build_draft(draft, aux, vocab, attention="sdpa")


def export_config(config: RunConfig, reference: dict, fmt: str) -> dict:
    if fmt == "reference":
        return reference
    return speculators_config(reference, serving_path(config.target), architectures(config.target),
                              config.validate_.num_speculative_tokens[0])


def write_export(stage: Stage, fmt: str, state: dict, config_json: dict, card: dict) -> Path:
    """One format's folder, complete or absent: weights, config.json, spec.json (read back), README.md."""
    tensors = {name: t.to(export_dtype(t)).contiguous() for name, t in export_state_dict(state, fmt).items()}
    with stage.atomic(fmt) as tmp:
        tmp.mkdir()
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
        (tmp / SPEC_FILE).write_text(json.dumps(read_spec(tmp).to_json(), indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(fmt, config_json, card, stage.path(fmt)))
    return stage.path(fmt)


def model_card_facts(config: RunConfig, step_dir: Path, metrics: dict | None, facts: dict, data_dir: Path) -> dict:
    data = read_manifest(data_dir) or {}
    return {"config": config, "checkpoint": step_dir.name, "metrics": metrics, "facts": facts,
            "data_counts": data.get("counts", {})}


def model_card(fmt: str, config_json: dict, card: dict, final_dir: Path) -> str:
    """README.md: target, data, training config, eval metrics, serving command."""
    config: RunConfig = card["config"]
    note = serving_note(config, final_dir)
    target = config.target.stand_in and f"stand-in `{config.target.stand_in}`" or f"`{config.target.path}`"
    sources = ", ".join(f"{s.kind}{f' {s.name}' if s.name else ''}{f' (limit {s.limit})' if s.limit else ''}"
                        for s in config.data.sources)
    metrics = card["metrics"]
    metric_lines = ["| TTT step | eval top-1 accuracy | eval KL |", "|---|---|---|"] + [
        f"| {k} | {acc:.4f} | {loss:.4f} |" for k, (acc, loss) in enumerate(zip(metrics["eval_accuracy"], metrics["eval_loss"]))
    ] if metrics else ["no eval record at this checkpoint"]
    simulated = (metrics or {}).get("simulated_acceptance") or {}
    ks = overall_ks(simulated)
    per_position = {k: ", ".join(format(simulated[metric_key(k, i)], ".3f") for i in range(1, k + 1)) for k in ks}
    simulated_lines = ["| k | mean acceptance length | acceptance per position |", "|---|---|---|"] + [
        f"| {k} | {simulated[metric_key(k)]:.3f} | {per_position[k]} |" for k in ks
    ] if ks else ["not simulated (the eval answers are not the target's greedy ones)"]
    draft = config.draft.model_dump()
    train = config.train.model_dump()
    return "\n".join([
        f"# EAGLE-3 draft for {target} ({fmt} format)", "",
        (f"One {'Llama-style' if config.draft.attention == 'llama' else 'DeepSeek-V3-style (MLA)'} decoder layer "
         f"({attention_summary(config.draft)}) reading the target's aux hidden states "
         f"{(config_json.get('eagle_config') or config_json)['eagle_aux_hidden_state_layer_ids']} "
         "(vLLM convention: id i = the residual stream entering layer i). No `embed_tokens`: vLLM shares the target's."),
        "", "## Target", f"- {target}, vocabulary {card['facts']['vocab_size']}, {card['facts']['num_hidden_layers']} layers",
        "", "## Data", f"- sources: {sources}; answers regenerated by the target: {config.data.regenerate.enabled}",
        f"- samples (01_data): {card['data_counts'] or 'unknown'}",
        "", "## Training", f"- checkpoint `{card['checkpoint']}` of {config.train.max_steps} steps",
        f"- draft: `{json.dumps(draft)}`", f"- train: `{json.dumps(train)}`",
        "", "## Eval metrics (04_train, teacher forced; acceptance of the (k+1)-th draft token)", *metric_lines,
        "", "## Simulated acceptance (04_train: greedy chain drafting replayed on the eval split's greedy answers, "
        f"up to {config.validate_.max_tokens} tokens per turn; 06_validate measures it in vLLM)", *simulated_lines,
        "", "## Serving", "```", serving_command(config, final_dir), "```", *([f"({note})"] if note else []), "",
    ])
