"""Stage 06: the worker extension of 06's engines (`LLM(worker_extension_cls=WORKER_EXTENSION)`).

vLLM imports this module in every worker before the model loads, which installs the weights probe's recorder;
its methods run in each worker through `llm.collective_rpc`.
"""

from __future__ import annotations

from eagle3_pipeline.validate.speed import StepTimer
from eagle3_pipeline.validate.weights_probe import DraftWeightsProbe

WORKER_EXTENSION = "eagle3_pipeline.validate.worker.ValidateWorker"


class ValidateWorker(DraftWeightsProbe, StepTimer):
    """What 06 asks each worker: which draft parameters loaded (weights_probe.py), how long each part of
    an engine step takes (speed.py)."""
