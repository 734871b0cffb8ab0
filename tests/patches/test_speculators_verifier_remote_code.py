"""speculators 0.9.0 reading a verifier config that needs remote code, with and without the patch."""

from __future__ import annotations

import json

import pytest

REMOTE_CONFIG = '''
from transformers import PretrainedConfig


class RemoteVerifierConfig(PretrainedConfig):
    model_type = "remote_verifier"

    def __init__(self, hidden_size=64, **kwargs):
        self.hidden_size = hidden_size
        super().__init__(**kwargs)
'''


@pytest.fixture
def remote_verifier(tmp_path):
    """A model folder whose config class is its own code, as Kimi-K2.5's is for transformers < 5.13."""
    (tmp_path / "configuration_remote.py").write_text(REMOTE_CONFIG)
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "remote_verifier", "hidden_size": 64,
        "auto_map": {"AutoConfig": "configuration_remote.RemoteVerifierConfig"},
    }))
    return tmp_path


@pytest.fixture
def eagle3_core(monkeypatch):
    from speculators.models.eagle3 import core

    monkeypatch.setattr(core, "AutoConfig", core.AutoConfig)  # restored after the test
    return core


def test_unpatched_speculators_cannot_read_it(eagle3_core, remote_verifier):
    with pytest.raises(ValueError, match="trust_remote_code|custom code"):
        eagle3_core.AutoConfig.from_pretrained(str(remote_verifier))


def test_patched_speculators_reads_it_and_native_types_stay_native(eagle3_core, remote_verifier, smollm2_dir):
    from patches.speculators_verifier_remote_code import apply

    apply()
    apply()  # re-entrant
    config = eagle3_core.AutoConfig.from_pretrained(str(remote_verifier))
    assert type(config).__name__ == "RemoteVerifierConfig" and config.hidden_size == 64
    assert type(eagle3_core.AutoConfig.from_pretrained(str(smollm2_dir))).__name__ == "LlamaConfig"
