"""`ExampleHiddenStatesConnector` for vLLM's CPU backend, registered as "CPUHiddenStatesConnector".

Upstream's connector copies each finished request's hidden states to the host asynchronously and assumes
CUDA in three spots: it allocates the host buffer with `pin_memory=True` (no pinned allocator without an
accelerator), its writer thread waits on the copy's `event.synchronize()`, and `get_finished` polls
`event.query()`; on the CPU backend `torch.cuda.Event` is vLLM's placeholder, without `query`. On CPU
the "device" is host memory: the copy is complete when it returns, so those events are completed events
and the buffer needs no pinning. Nothing else changes: same files, same locks, same output paths.
"""

from __future__ import annotations

import contextlib

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
)


class CompletedEvent:
    """A `torch.cuda.Event` whose work is already done: on CPU every copy completes before it returns."""

    def record(self, *args, **kwargs) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


@contextlib.contextmanager
def host_only_copies():
    """While the connector extracts and queues writes: completed events, host buffers without pinning."""
    event, empty_like = torch.cuda.Event, torch.empty_like

    def unpinned_empty_like(*args, pin_memory: bool = False, **kwargs):
        return empty_like(*args, **kwargs)

    torch.cuda.Event, torch.empty_like = CompletedEvent, unpinned_empty_like
    try:
        yield
    finally:
        torch.cuda.Event, torch.empty_like = event, empty_like


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # Upstream extracts finished requests here (`_submit_async_write`: the pinned buffer and both
        # events are made inside this call), hands the copy's event to the writer thread
        # (`_write_tensors`: event.synchronize()) and polls the events (event.query()).
        with host_only_copies():
            return super().get_finished(finished_req_ids)
