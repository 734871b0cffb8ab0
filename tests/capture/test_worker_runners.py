"""The capture worker reads a step's requests from either model runner, and refuses a runner it cannot read
before any engine starts (`check_runner_support`)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from eagle3_pipeline.capture import worker as capture_worker
from eagle3_pipeline.capture.worker import StepBatch, check_runner_support, runner_kind


def test_runner_kinds_of_the_installed_vllm():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    assert (runner_kind(V1Runner), runner_kind(V2Runner)) == ("v1", "v2")
    check_runner_support()  # the installed vLLM has what both readers need


@pytest.mark.parametrize("table, name", [("RUNNER_ATTRIBUTES", "v1"), ("RUNNER_ATTRIBUTES", "v2"),
                                         ("INPUT_BATCH_FIELDS", None)])
def test_a_runner_without_what_the_capture_reads_is_refused(monkeypatch, table, name):
    if name is None:
        monkeypatch.setattr(capture_worker, table, ("req_ids", "no_such_field"))
    else:
        monkeypatch.setattr(capture_worker, table, {**capture_worker.RUNNER_ATTRIBUTES, name: ("no_such_member",)})
    with pytest.raises(RuntimeError, match="no_such_"):
        check_runner_support()


def test_model_runner_v2_batch_is_the_prepared_one_once():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner

    runner = object.__new__(V2Runner)
    prepared = SimpleNamespace(req_ids=["a", "b"], query_start_loc_np=np.array([0, 3, 5, 5], dtype=np.int32),
                               input_ids=torch.arange(8))
    runner.prepare_inputs = lambda scheduler_output, batch_desc: prepared
    batch = StepBatch.follow(runner)
    assert batch.take() is None  # a forward without a prepared batch: a dummy step, not recorded
    assert runner.prepare_inputs(None, None) is prepared  # the runner still gets its batch
    req_ids, starts, input_ids = batch.take()
    assert (req_ids, starts, input_ids.tolist()) == (["a", "b"], [0, 3, 5], list(range(8)))
    assert batch.take() is None  # used by one forward only


def test_v1_batch_is_read_from_the_runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    runner = object.__new__(V1Runner)
    runner.input_batch = SimpleNamespace(req_ids=["a"])
    runner.query_start_loc = SimpleNamespace(cpu=torch.tensor([0, 4, 0]))
    runner.input_ids = SimpleNamespace(gpu=torch.arange(6))
    req_ids, starts, input_ids = StepBatch.follow(runner).take()
    assert (req_ids, starts, input_ids.tolist()) == (["a"], [0, 4], list(range(6)))


def test_a_vllm_without_model_runner_v1_needs_only_v2s_fields(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_model_runner", None)  # vLLM 0.34: the module is gone
    check_runner_support()


def test_a_subclass_of_model_runner_v2_is_read_as_v2():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    # vLLM 0.34's CPU runner subclasses V2 from its own module; before 0.34 it subclassed V1
    cpu_runner_034 = type("CPUModelRunner", (V2Runner,), {"__module__": "vllm.v1.worker.cpu.model_runner"})
    cpu_runner_032 = type("CPUModelRunner", (V1Runner,), {"__module__": "vllm.v1.worker.cpu_model_runner"})
    assert (runner_kind(cpu_runner_034), runner_kind(cpu_runner_032)) == ("v2", "v1")
