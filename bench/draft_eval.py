"""One teacher-forced evaluator for any EAGLE-3 draft folder, on our eval split.

Both trainers' drafts load as the training draft (`Eagle3Draft`): speculators' from its checkpoint (speculators'
loader), ours from 05_export/reference/ (either attention; built from its config.json), each with the verifier's
frozen tensors, and run the same training-time-test unroll, 04's own (`Eagle3Draft.forward`), on the same packed
eval rows (our 01 eval split + 02 states, packed as 04 packs them), in float32, honouring each draft's own config
flags (`norm_before_fc`, `fc_norm`, `norm_output`, `norm_before_residual` inside the decoder layer). Document-aware
masks (eagle3_pipeline/train/attention.py) and targets: the verifier's top-1 over the draft vocabulary at the row
the step predicts, counted where that row is in the same document and loss-masked
(eagle3_pipeline/train/draft_model.py, `VerifierTargets`).

Per TTT step k it reports
    acc_k        top-1 agreement at step k with the true tokens before it (our 04 metric; teacher forcing)
    chain_acc_k  agreement at steps 0..k all at once, over the rows counted at step k: with greedy decoding
                 the tokens fed to step k are then the draft's own, so this is the teacher-forced
                 counterpart of vLLM's acceptance at position k+1
    loss_k       forward KL(verifier || draft) over the draft vocabulary

and, at each k of `ks`, the acceptance length vLLM would measure with greedy chain drafting, replayed on the
eval split's greedy answers exactly as 04's eval does (eagle3_pipeline/train/acceptance.py): `al_k<k>`,
`al_k<k>_pos<i>`, and both per eval source (`/<source>`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from eagle3_pipeline.acceptance import AcceptanceCounts
from eagle3_pipeline.data.dataset import open_split
from eagle3_pipeline.draft_spec import FROZEN
from eagle3_pipeline.export.format import WEIGHTS_FILE, draft_fields
from eagle3_pipeline.pack_plan import plan_packs, training_rows
from eagle3_pipeline.train.acceptance import chain_metrics, replay_batch, target_proposals
from eagle3_pipeline.train.data import PackedRows
from eagle3_pipeline.train.draft_model import STATS, Eagle3Draft, VerifierTargets, build_draft
from eagle3_pipeline.train.inputs import served_samples


def load_draft(folder: Path, verifier_dir: Path | None = None, weight_prefix: str = ""):
    """The draft in `folder`, either format: speculators' (loaded by speculators, its config naming the verifier)
    or the reference layout (our export, either attention: built from its config.json, `midlayer.*` read back as
    `layers.0.*`). The frozen tensors come from the verifier (`verifier_dir`, default the one a speculators config
    names; names under `weight_prefix`) for every draft: both trainers freeze them at the verifier's, neither
    format stores them, and speculators 0.9.0's own loader neither knows a prefix such as Kimi's `language_model.`
    nor, under transformers 5, keeps its "not loaded" sentinel on the embedding (the init of missing keys
    overwrites it)."""
    from eagle3_pipeline.train.verifier import load_verifier_weights

    config_json = json.loads((folder / "config.json").read_text())
    if "speculators_config" in config_json:
        config = Eagle3Draft.config_class.from_pretrained(str(folder))
        config.transformer_layer_config._attn_implementation = "sdpa"  # not serialised; our dense masks
        model = Eagle3Draft.from_pretrained(str(folder), config=config)
        verifier_dir = verifier_dir or Path(config.speculators_config.verifier.name_or_path)
    elif verifier_dir is None:
        raise ValueError(f"{folder}: a reference-layout draft does not name its verifier: pass verifier_dir")
    else:
        model = reference_draft(folder, config_json)
    verifier = load_verifier_weights(verifier_dir, weight_prefix)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(verifier.embed_tokens)
        model.verifier_norm.weight.copy_(verifier.norm)
        model.verifier_lm_head.weight.copy_(verifier.lm_head if model.t2d is None else verifier.lm_head[model.t2d])
    model.verifier_norm.variance_epsilon = verifier.norm_eps
    return model.float().eval()


def reference_draft(folder: Path, config_json: dict) -> Eagle3Draft:
    """A reference-layout export as the training draft (05's renaming undone); every stored tensor must fit."""
    draft, aux_layer_ids, target_vocab_size = draft_fields(config_json)
    model = build_draft(draft, aux_layer_ids, target_vocab_size, attention="sdpa")
    stored = load_file(str(folder / WEIGHTS_FILE))
    state = {name.replace("midlayer.", "layers.0.", 1): tensor for name, tensor in stored.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    unfilled = sorted(set(missing) - set(FROZEN))  # the frozen tensors come from the verifier (load_draft)
    if unexpected or unfilled:
        raise ValueError(f"{folder} does not fit the draft its config.json describes: missing {unfilled}, "
                         f"unexpected {sorted(unexpected)}")
    return model


class EvalRows:
    """Our eval split as packed rows, packed once (seed 0) and shared by every draft evaluated."""

    def __init__(self, run_dir: Path, packed_length: int):
        split = open_split(run_dir / "01_data", "eval")
        states = run_dir / "02_hidden_states"
        rows_per_sample = training_rows(np.asarray(split["seq_len"], dtype=np.int64))
        self.rows = PackedRows(split, states, packed_length, aux_width=0, hidden_size=0)
        self.packs = plan_packs(rows_per_sample, packed_length, seed=[0])
        self.samples = served_samples(split)  # source, seq_len, prompt_len per eval row
        self._batches = None

    def batches(self, aux_width: int, hidden_size: int):
        if self._batches is None:
            self.rows.aux_width, self.rows.hidden_size = aux_width, hidden_size
            self._batches = []
            for pack in self.packs:
                rows = self.rows[None, pack]
                self._batches.append({k: v.unsqueeze(0).float() if v.is_floating_point() else v.unsqueeze(0)
                                      for k, v in rows.items()})
        return self._batches


@torch.no_grad()
def unroll(model: Eagle3Draft, batch: dict, ttt_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[4, ttt_steps] sums over the batch (kl_sum, correct, chain_correct, count) and the draft's top-1 per
    step and row [B, ttt_steps, L] (draft vocab ids, -1 past the rows a step has): the model's own training
    unroll (Eagle3Draft.forward), so every layout is evaluated as it trains, plus the chain agreement."""
    document_ids, loss_mask = batch["document_ids"], batch["loss_mask"]
    _, stats, top1 = model(batch["aux"], batch["final"], batch["input_ids"], batch["position_ids"], document_ids,
                           loss_mask, ttt_steps, [1.0] * ttt_steps)
    verifier_top1 = model.verifier_lm_head(model.verifier_norm(batch["final"])).argmax(-1)
    chain = torch.ones_like(loss_mask, dtype=torch.bool)  # row t: steps 0..k-1 all correct
    chain_correct = []
    for step in range(ttt_steps):
        counted = VerifierTargets.counted(loss_mask, document_ids, step)
        rows = counted.shape[1]
        chain = chain[:, :rows] & (top1[:, step, :rows] == verifier_top1[:, step:])
        chain_correct.append((chain & counted).sum().float())
    kl_sum, correct, count = (stats[STATS.index(name)] for name in ("kl_sum", "correct", "count"))
    return torch.stack([kl_sum, correct, torch.stack(chain_correct), count]), top1


def evaluate(folder: Path, eval_rows: EvalRows, ttt_steps: int, ks: list[int] = (), max_tokens: int = 0,
             device: str = "cpu", verifier_dir: Path | None = None, weight_prefix: str = "") -> dict[str, float]:
    """Teacher-forced figures per TTT step, and the simulated acceptance at each k of `ks` (answers cut at
    `max_tokens`, as 06 serves them), computed on `device`; `verifier_dir` and `weight_prefix` as load_draft's."""
    model = load_draft(folder, verifier_dir, weight_prefix).to(device)
    aux_width = model.fc.in_features
    steps = max([ttt_steps, *ks])  # a k past the trained steps unrolls the chain further
    totals = torch.zeros(4, steps)
    sources = dict.fromkeys(sample["source"] for sample in eval_rows.samples)
    chains = {(source, k): AcceptanceCounts(k) for source in sources for k in ks}
    for batch, pack in zip(eval_rows.batches(aux_width, model.hidden_size), eval_rows.packs):
        batch = {key: value.to(device) for key, value in batch.items()}
        batch_totals, top1 = unroll(model, batch, steps)
        totals += batch_totals.cpu()
        if chains:
            replay_batch(target_proposals(top1, model.d2t), batch, [pack], eval_rows.samples, max_tokens, chains)
    kl, correct, chain, count = totals.double()
    count = count.clamp(min=1)
    values = {}
    for k in range(ttt_steps):
        values[f"acc_{k}"] = float(correct[k] / count[k])
        values[f"chain_acc_{k}"] = float(chain[k] / count[k])
        values[f"loss_{k}"] = float(kl[k] / count[k])
    return values | chain_metrics(chains)
