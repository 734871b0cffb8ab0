"""Fixtures of the patch tests: vLLM 0.16's source, an engine on a stand-in, errors against transformers."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from eagle3_pipeline.config_sections import TargetConfig
from eagle3_pipeline.engine import start_engine
from tests.patches.vllm_source import Source, unpacked_vllm

# Released vLLMs whose source the anchors are checked in (the patches' `versions`): 0.16.0 by default.
VERSIONS = os.environ.get("EAGLE3_VLLM_SOURCE_VERSIONS", "0.16.0").split(",")


@pytest.fixture(scope="module", params=VERSIONS)
def vllm_source(request) -> Source:
    return Source(unpacked_vllm(request.param))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| over the whole tensor, in float32."""
    expected = expected.float()
    return ((actual.float() - expected).norm() / expected.norm()).item()


@contextlib.contextmanager
def running_llm(model_dir, **settings):
    """A small vLLM engine in this process, shut down on exit (one per test module: starts take ~30-60 s)."""
    llm = start_engine(TargetConfig(path=str(model_dir)), model_dir, max_num_seqs=4, **settings)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
