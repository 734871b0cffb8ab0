"""vLLM on CPU: a hidden-states KV connector that works without CUDA (for `extract_hidden_states`).

On the CPU backend, use `hidden_states_connector()` as the `kv_connector` of the `kv_transfer_config`
that goes with `speculative_config={"method": "extract_hidden_states", ...}`.
"""

from __future__ import annotations

from patches.ledger import outcome
from patches.patch import APPLIED, Patch

NAME = "CPUHiddenStatesConnector"
UPSTREAM_NAME = "ExampleHiddenStatesConnector"
CLASS_MODULE = "patches.vllm_classes.cpu_hidden_states_connector"


def hidden_states_connector() -> str:
    """The KV connector name for `extract_hidden_states` here: the CPU-safe one where it is registered."""
    result = outcome(PATCH.name)
    return NAME if result is not None and result.state == APPLIED else UPSTREAM_NAME


def on_accelerator() -> str | None:
    from vllm.platforms import current_platform

    return None if current_platform.is_cpu() else f"not the CPU backend ({current_platform.device_type})"


def apply() -> str:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    KVConnectorFactory.register_connector(NAME, CLASS_MODULE, NAME)
    return f"registered KV connector {NAME} ({CLASS_MODULE}), a CPU-safe {UPSTREAM_NAME}"


PATCH = Patch(
    name="vllm-cpu-hidden-states-connector",
    package="vllm",
    affected=">=0.22",
    versions=">=0.32,<0.33",
    why=(
        "Since vLLM 0.22 ExampleHiddenStatesConnector (the writer behind the extract_hidden_states speculative "
        "method) copies hidden states to the host asynchronously and assumes CUDA: pin_memory=True host "
        "buffers, event.synchronize() in its writer thread, event.query() in get_finished. On the CPU backend "
        "the first raises and the last hits vLLM's placeholder event, so no hidden states are written."
    ),
    how=(
        "KVConnectorFactory.register_connector adds CPUHiddenStatesConnector, a subclass whose get_finished "
        "runs upstream's with completed events and unpinned host buffers (the copy on CPU is synchronous). "
        "Registered on the CPU platform only; stages pick it with hidden_states_connector()."
    ),
    upstream="none yet (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py)",
    remove_when="vLLM's hidden-states connector runs on the CPU backend (check it with the test of this patch)",
    apply=apply,
    not_needed_here=on_accelerator,
)
