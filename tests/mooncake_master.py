"""A Mooncake master on 127.0.0.1 for the tests of the Mooncake transport: started, awaited, stopped."""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

STARTUP_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def master_binary() -> Path:
    spec = importlib.util.find_spec("mooncake")
    assert spec is not None and spec.submodule_search_locations, (
        "the Mooncake client is not installed: run `make setup` (mooncake-transfer-engine-non-cuda)")
    return Path(list(spec.submodule_search_locations)[0]) / "mooncake_master"


@contextlib.contextmanager
def running_master(log: Path) -> Iterator[tuple[str, int, subprocess.Popen]]:
    """(master address, admin port, process) of a master serving until the block ends."""
    rpc_port, admin_port = free_port(), free_port()
    with open(log, "w") as output:
        process = subprocess.Popen(
            [str(master_binary()), "-rpc_address", "127.0.0.1", f"-rpc_port={rpc_port}", "-metrics_host",
             "127.0.0.1", f"-metrics_port={admin_port}"], stdout=output, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert process.poll() is None, f"mooncake_master exited {process.returncode}: {log.read_text()[-2000:]}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/health", timeout=2) as answer:
                    if b'"service_ready":true' in answer.read():
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"mooncake_master did not start in {STARTUP_TIMEOUT_S:.0f} s"
            time.sleep(0.1)
        yield f"127.0.0.1:{rpc_port}", admin_port, process
    finally:
        process.kill()
        process.wait()


def mooncake_settings(master: str, admin_port: int, key_prefix: str) -> list[str]:
    """`--set` overrides that send a run's stream through this master."""
    return ["capture.stream.transport=mooncake", f"capture.stream.mooncake.master={master}",
            f"capture.stream.mooncake.admin_port={admin_port}", "capture.stream.mooncake.local_hostname=127.0.0.1",
            f"capture.stream.mooncake.key_prefix={key_prefix}"]
