"""vLLM 0.16.0's own `SpeculativeConfig._verify_args`, run under the `vllm-eagle3-target-check` wrapper.

The validator is taken from the 0.16.0 source and compiled into a pydantic dataclass made with the
installed vLLM's `@config` decorator, then wrapped exactly as `apply()` wraps the real one.
"""

from __future__ import annotations

import ast
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError, model_validator

from patches.vllm_eagle3_target_check import ACCEPTED_MODEL_TYPES, accept_deepseek_and_kimi
from tests.patches.vllm_source import Source

SPECULATIVE = "vllm/config/speculative.py"


def config_with_016_validator(source: Source) -> type:
    from vllm.config.utils import config

    methods = "\n".join(ast.unparse(source.function(SPECULATIVE, name, "SpeculativeConfig"))
                        for name in ("_verify_args", "verify_equal_vocab_size_if_draft_model"))
    code = "@config\nclass SpeculativeConfig:\n" + textwrap.indent(
        "method: str = 'eagle3'\nnum_speculative_tokens: Any = 3\ntensor_parallel_size: Any = None\n"
        "draft_model_config: Any = None\ndisable_by_batch_size: Any = None\ntarget_model_config: Any = None\n"
        + methods, "    ")
    # __name__: the class's annotations resolve in this module, which imports Any.
    namespace = {"__name__": __name__, "config": config, "model_validator": model_validator, "Any": Any, "Self": Any}
    exec(code, namespace)  # noqa: S102 - vLLM 0.16.0's own validator source, from its wheel
    return namespace["SpeculativeConfig"]


def target(model_type: str) -> SimpleNamespace:
    return SimpleNamespace(hf_text_config=SimpleNamespace(model_type=model_type))


def test_016_validator_rejects_then_accepts_deepseek_and_kimi(vllm_source):
    SpeculativeConfig = config_with_016_validator(vllm_source)
    with pytest.raises(ValidationError, match="is only supported for"):
        SpeculativeConfig(target_model_config=target("deepseek_v3"))

    accept_deepseek_and_kimi(SpeculativeConfig)
    accept_deepseek_and_kimi(SpeculativeConfig)  # re-entrant: wrapped once
    assert not hasattr(SpeculativeConfig.__pydantic_decorators__.model_validators["_verify_args"].func.__wrapped__,
                       "__wrapped__")
    for model_type in (*ACCEPTED_MODEL_TYPES, "llama"):
        assert SpeculativeConfig(target_model_config=target(model_type)).method == "eagle3"
    with pytest.raises(ValidationError, match="is only supported for"):
        SpeculativeConfig(target_model_config=target("gpt2"))  # the allowlist still holds for others
    with pytest.raises(ValidationError, match="greater than zero"):
        SpeculativeConfig(num_speculative_tokens=0, target_model_config=target("deepseek_v3"))  # earlier checks too
