"""``dpu-frontend check`` on a machine with a real RDMA device (soft-RoCE)."""

from __future__ import annotations

import subprocess

import pytest

from dpu_frontend.softroce.harness import RXE_IP
from dpu_frontend.softroce.processes import CLI
from tests.stack import running_stack

pytestmark = pytest.mark.rdma


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "check", "--transport", "verbs", *args], capture_output=True,
                          text=True, timeout=600, check=False)


def test_a_good_verbs_deployment_is_ready() -> None:
    with running_stack("verbs", serve_args=("--channel", "0"),
                       peer_args=("--channels", "2")) as stack:
        result = check("--rdma-ip", RXE_IP, "--peer", stack.peers[0].address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[ ok ] RDMA device rxe0: port 1 4: ACTIVE" in result.stdout
    assert f"[ ok ] will use rxe0 port 1 GID index 1 ({RXE_IP})" in result.stdout
    assert "[ ok ] RLIMIT_MEMLOCK" in result.stdout
    assert "channel 1 of 2" in result.stdout


def test_a_missing_rdma_device_is_named_beside_the_one_present() -> None:
    result = check("--rdma-device", "nosuchdev", "--peer", "127.0.0.1:1")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[ ok ] RDMA device rxe0: port 1 4: ACTIVE" in result.stdout
    assert ("[FAIL] RDMA device nosuchdev not found or has no RoCE v2 GID (rdma link show; "
            "ibv_devinfo)\n       fix: set rdma_ip/rdma_device to a RoCE v2 GID listed above"
            ) in result.stdout
    assert "[FAIL] GPU peer 127.0.0.1:1" in result.stdout
    assert "2 problem(s) found" in result.stdout
