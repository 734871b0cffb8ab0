"""Fabricated inputs for stages 03 and 04: a tiny target checkpoint, finished 01_data and 02_hidden_states
(written by eagle3_pipeline/stand_ins/fabricated_stages.py, the stages' own writers), a whole tiny run.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import save_file

from eagle3_pipeline.capture import stage as capture
from eagle3_pipeline.capture.store import SampleStates, write_index, write_shard
from eagle3_pipeline.config import RunConfig, parse_config
from eagle3_pipeline.stage_io import build_once
from eagle3_pipeline.stand_ins.fabricated_stages import humaneval_samples, write_data_stage, write_states_stage
from tests.conftest import CONFIGS

TINY = {"hidden": 64, "vocab": 512, "aux_layer_ids": [1, 2, 3]}
TINY_LAYERS = 4  # what the tiny target's config.json declares (it holds no layer weights)


def tiny_target(folder: Path, hidden: int = TINY["hidden"], vocab: int = TINY["vocab"], prefix: str = "",
                shards: int = 1, tied: bool = False, seed: int = 0) -> Path:
    """A target checkpoint holding only the tensors the draft borrows (plus a decoy), optionally sharded."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        f"{prefix}model.embed_tokens.weight": (0.1 * torch.randn(vocab, hidden, generator=gen)).to(torch.bfloat16),
        f"{prefix}model.norm.weight": (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16),
        f"{prefix}model.layers.0.mlp.down_proj.weight": torch.randn(hidden, hidden, generator=gen).to(torch.bfloat16),
    }
    if not tied:
        tensors[f"{prefix}lm_head.weight"] = (0.1 * torch.randn(vocab, hidden, generator=gen)).to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "hidden_size": hidden, "vocab_size": vocab, "rms_norm_eps": 1e-5,
              "num_hidden_layers": TINY_LAYERS, "tie_word_embeddings": tied}
    (folder / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
        return folder
    names = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::shards]}
        save_file(part, str(folder / file))
        weight_map |= dict.fromkeys(part, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def tiny_run_config(run_dir: Path, target_dir: Path, capture: dict | None = None, draft: dict | None = None,
                    export: dict | None = None, weight_prefix: str = "", **train: object) -> tuple[RunConfig, Path]:
    """configs/demo.yaml shrunk to the tiny target; returns the config and the YAML file the scripts read."""
    tree = yaml.safe_load((CONFIGS / "demo.yaml").read_text())
    tree["run_dir"] = str(run_dir)
    tree["target"] = {"path": str(target_dir), "weight_prefix": weight_prefix}
    tree["export"] |= export or {}
    tree["capture"] |= {"aux_layer_ids": TINY["aux_layer_ids"], **(capture or {})}
    tree["draft"] = {"hidden_size": TINY["hidden"], "num_attention_heads": 2, "num_key_value_heads": 1,
                     "head_dim": 32, "intermediate_size": 128, "draft_vocab_size": 128, "rope_theta": 10000.0,
                     "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, **(draft or {})}
    tree["train"] = {"max_steps": 6, "packed_length": 64, "learning_rate": 3e-3, "warmup_steps": 2,
                     "mixed_precision": "no", "checkpoint_every": 3, "eval_every": 3, "log_every": 1,
                     "num_workers": 0, **train}
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return parse_config(tree, str(path)), path


def random_samples(count: int, vocab: int, seed: int, prefix: str) -> list[dict]:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        length = int(rng.integers(10, 40))
        prompt = int(rng.integers(2, length // 2))
        samples.append({"id": f"{prefix}{i:04d}", "input_ids": rng.integers(0, vocab, length).tolist(),
                        "loss_mask": [0] * prompt + [1] * (length - prompt)})
    return samples


def write_shard_folder(folder: Path, states: list[SampleStates]) -> Path:
    """A folder of 02's shards and index alone (no stage), for readers' tests; all aux columns, final id 1 more."""
    num_aux, hidden = states[0].aux.shape[1:]
    entries = write_shard(folder / "shard_00000.safetensors", states, "bfloat16")
    layout = capture.states_layout(list(range(num_aux)), num_aux, hidden, "bfloat16")
    write_index(folder, entries, layout, dict.fromkeys(entries, "train"))
    return folder


def random_states(samples: list[dict], num_aux: int, hidden: int, seed: int) -> list[SampleStates]:
    gen = torch.Generator().manual_seed(seed)
    return [SampleStates(s["id"], torch.randn(len(s["input_ids"]), num_aux, hidden, generator=gen),
                         torch.randn(len(s["input_ids"]), hidden, generator=gen)) for s in samples]


def write_vocab_stage(config: RunConfig) -> None:
    from eagle3_pipeline import vocab

    vocab.run(config)


def tiny_run(tmp_path: Path, name: str = "run", draft: dict | None = None, export: dict | None = None,
             weight_prefix: str = "", **train: object) -> tuple[RunConfig, Path]:
    """A finished 01/02/03 on the tiny target with random states (`draft` and `export` override those sections;
    the target's tensors are named under `weight_prefix`); returns the config and its YAML file."""
    target = tmp_path / ("target" + weight_prefix.replace(".", "_"))
    if not (target / "config.json").exists():
        tiny_target(target, prefix=weight_prefix)
    config, path = tiny_run_config(tmp_path / name, target, draft=draft, export=export, weight_prefix=weight_prefix,
                                   **train)
    train_samples = random_samples(24, TINY["vocab"], seed=1, prefix="t")
    eval_samples = random_samples(6, TINY["vocab"], seed=2, prefix="e")
    write_data_stage(config, train_samples, eval_samples, TINY["vocab"])
    states = random_states(train_samples + eval_samples, len(TINY["aux_layer_ids"]), TINY["hidden"], seed=3)
    write_states_stage(config, states, TINY["aux_layer_ids"])
    write_vocab_stage(config)
    return config, path


# ------------------------------------------------------------------- real inputs from the SmolLM2 target
REAL_INPUTS_VERSION = 1  # bump when the construction below changes: the cached file is rebuilt
SMOLLM2_AUX_LAYER_IDS = [2, 15, 27]  # (2, L//2, L-3) for its 30 layers, vLLM convention


def smollm2_humaneval_inputs(model_dir: Path, count: int, max_tokens: int = 256) -> tuple[list[dict], list]:
    """`count` real chats (HumanEval: a one-line request, answered with the reference function) and SmolLM2's
    hidden states on them (HF transformers, fp32): aux = output_hidden_states[i], final = the last layer's
    output before the final norm. Built once, then read from the cache (the forward pass costs minutes here).
    """
    def build() -> list[dict]:
        return humaneval_samples(model_dir, count, max_tokens)

    return cached_inputs(f"smollm2-humaneval-{count}-{max_tokens}-v{REAL_INPUTS_VERSION}", model_dir, build)


def cached_inputs(name: str, model_dir: Path, build_samples) -> tuple[list[dict], list]:
    """(samples, SmolLM2 hidden states) from the cache file `name`, or built by `build_samples()` and
    `_smollm2_states`, then cached (the forward pass costs minutes here)."""
    from eagle3_pipeline.stand_ins import cache_dir

    cached = cache_dir() / "test_inputs" / f"{name}.pt"
    def build(tmp: Path) -> None:
        samples = build_samples()
        states = _smollm2_states(model_dir, samples)
        torch.save({"samples": samples, "states": [vars(s) for s in states]}, tmp)

    build_once(cached, cached.exists, build)
    saved = torch.load(cached, weights_only=False)
    return saved["samples"], [SampleStates(**s) for s in saved["states"]]


@torch.no_grad()
def _smollm2_states(model_dir: Path, samples: list[dict]) -> list[SampleStates]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    captured = {}
    model.model.layers[-1].register_forward_hook(lambda _m, _i, out: captured.update(final=out))
    states = []
    for sample in samples:
        out = model.model(torch.tensor([sample["input_ids"]]), output_hidden_states=True)
        aux = torch.stack([out.hidden_states[i][0] for i in SMOLLM2_AUX_LAYER_IDS], dim=1)
        final = captured["final"][0] if captured["final"].dim() == 3 else captured["final"][0][0]
        states.append(SampleStates(sample["id"], aux.to(torch.bfloat16), final.to(torch.bfloat16)))
    return states
