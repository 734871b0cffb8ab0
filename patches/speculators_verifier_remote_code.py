"""speculators 0.9.0: load a verifier config that needs its own code (trust_remote_code).

Applied on request, not by the vLLM plugin: a stage whose target is configured with
`target.trust_remote_code: true` calls `patches.require_applied("speculators-verifier-remote-code")`
before `Eagle3DraftModel.load_verifier_weights()`.
"""

from __future__ import annotations

from patches.patch import Patch


def verifier_auto_config():
    """transformers' AutoConfig, but a config whose model type transformers does not know runs its code."""
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    class VerifierAutoConfig(AutoConfig):
        @classmethod
        def from_pretrained(cls, name_or_path, **kwargs):
            if "trust_remote_code" not in kwargs:
                config_dict, _ = PretrainedConfig.get_config_dict(name_or_path)
                # A model type transformers knows loads natively, exactly as before the patch.
                kwargs["trust_remote_code"] = config_dict.get("model_type") not in CONFIG_MAPPING
            return AutoConfig.from_pretrained(name_or_path, **kwargs)

    return VerifierAutoConfig


def apply() -> str:
    # Only the name inside speculators' EAGLE-3 module is rebound; transformers' AutoConfig is untouched.
    from speculators.models.eagle3 import core

    if core.AutoConfig.__name__ != "VerifierAutoConfig":
        core.AutoConfig = verifier_auto_config()
    return "speculators.models.eagle3.core.AutoConfig -> VerifierAutoConfig (trust_remote_code for unknown model types)"


PATCH = Patch(
    name="speculators-verifier-remote-code",
    package="speculators",
    affected="==0.9.*",
    versions="==0.9.0",
    why=(
        "Eagle3DraftModel.load_verifier_weights() reads the verifier config with AutoConfig.from_pretrained(path) "
        "and no trust_remote_code, and nothing in its API passes one. A verifier whose model type this "
        "transformers does not know (Kimi-K2.5's kimi_k25 before transformers 5.13) then fails to load."
    ),
    how=(
        "Rebinds AutoConfig inside speculators.models.eagle3.core to a subclass whose from_pretrained passes "
        "trust_remote_code=True only when transformers does not know the config's model_type; known types load "
        "natively as before. Applied only when a stage asks for it (its target sets trust_remote_code)."
    ),
    upstream="none yet (speculators/models/eagle3/core.py, Eagle3DraftModel.load_verifier_weights)",
    remove_when="speculators passes trust_remote_code through to the verifier config",
    apply=apply,
)
