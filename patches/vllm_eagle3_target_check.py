"""vLLM 0.16/0.17: let the speculative config accept DeepSeek/Kimi targets for EAGLE-3."""

from __future__ import annotations

import dataclasses
import functools

from patches.patch import Patch

# The text model types vLLM 0.18 added to the allowlist (Kimi-K2.5's text config is "deepseek_v3").
ACCEPTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2", "kimi_k25")
# The allowlist's error: 0.16 "Eagle3 is only supported for [...]", 0.17 "{method} is only supported for [...]".
REJECTION = "is only supported for"


def _wrap_verify_args(verify_args):
    """Wrap SpeculativeConfig's `_verify_args` validator so the allowlist lets DeepSeek/Kimi through."""

    @functools.wraps(verify_args)
    def _verify_args(self):
        try:
            return verify_args(self)
        except ValueError as error:
            target = self.target_model_config
            accepted = target is not None and target.hf_text_config.model_type in ACCEPTED_MODEL_TYPES
            if REJECTION not in str(error) or not accepted:
                raise
            # The allowlist is the validator's last check; this call is all that follows it upstream
            # (tests/patches/test_vllm016_source.py checks that in the 0.16.0 source).
            self.verify_equal_vocab_size_if_draft_model()
            return self

    _verify_args.accepts_deepseek_and_kimi = True
    return _verify_args


def accept_deepseek_and_kimi(config_cls: type) -> None:
    """Wrap the `_verify_args` validator of a vLLM config dataclass (re-entrant)."""
    # A pydantic dataclass compiled its validators into its schema when it was made: the decorator
    # entry is replaced and the schema rebuilt.
    from pydantic.dataclasses import rebuild_dataclass

    validators = config_cls.__pydantic_decorators__.model_validators
    validator = validators["_verify_args"]
    if not getattr(validator.func, "accepts_deepseek_and_kimi", False):
        validators["_verify_args"] = dataclasses.replace(validator, func=_wrap_verify_args(validator.func))
        rebuild_dataclass(config_cls, force=True)


def apply() -> str:
    from vllm.config.speculative import SpeculativeConfig

    accept_deepseek_and_kimi(SpeculativeConfig)
    return f"SpeculativeConfig._verify_args wrapped: EAGLE-3 targets {', '.join(ACCEPTED_MODEL_TYPES)} accepted"


PATCH = Patch(
    name="vllm-eagle3-target-check",
    package="vllm",
    affected="<0.18",
    versions=">=0.16,<0.18",
    why=(
        "vLLM 0.16/0.17's SpeculativeConfig rejects method 'eagle3' for any target whose text model type is "
        "not in a fixed allowlist (llama, qwen, ...), so an EAGLE-3 draft for Kimi-K2.5 (deepseek_v3 text "
        "model) fails at LLM(...) before the model is even loaded."
    ),
    how=(
        "The pydantic validator SpeculativeConfig._verify_args is wrapped (decorator entry replaced, schema "
        "rebuilt): the allowlist's ValueError is swallowed for deepseek_v2/deepseek_v3/kimi_k2/kimi_k25 "
        "targets, then the one check that follows it upstream runs. Everything else still raises."
    ),
    upstream="vLLM 0.18.0 vllm/config/speculative.py (aux_hidden_states_supported gains deepseek/kimi types)",
    remove_when="the GPU nodes run vLLM >= 0.18",
    apply=apply,
)
