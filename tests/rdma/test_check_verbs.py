"""``dpu-frontend check`` on a machine with a real RDMA device (soft-RoCE).

``check`` beside a serving daemon is in test_completion_verbs.py, on that module's
stack: each stack costs about a minute in the micro-VM."""

from __future__ import annotations

import subprocess

import pytest

from dpu_frontend.softroce.processes import CLI

pytestmark = pytest.mark.rdma


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "check", "--transport", "verbs", *args], capture_output=True,
                          text=True, timeout=600, check=False)


def test_a_missing_rdma_device_is_named_beside_the_one_present() -> None:
    result = check("--rdma-device", "nosuchdev", "--peer", "127.0.0.1:1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[ ok ] RDMA device rxe0: port 1 4: ACTIVE" in result.stdout
    assert ("[FAIL] RDMA device nosuchdev not found or has no RoCE v2 GID (rdma link show; "
            "ibv_devinfo)\n       fix: set rdma_ip/rdma_device to a RoCE v2 GID listed above"
            ) in result.stdout
    assert "[FAIL] GPU peer 127.0.0.1:1" in result.stdout
    assert "2 problem(s) found" in result.stdout
