"""``dpu-frontend check`` on a machine with a real RDMA device (soft-RoCE)."""

from __future__ import annotations

import subprocess

import pytest

from dpu_frontend.softroce.harness import RXE_IP
from dpu_frontend.softroce.processes import CLI
from tests.stack import running_stack

pytestmark = pytest.mark.rdma


def test_a_good_verbs_deployment_is_ready() -> None:
    with running_stack("verbs", serve_args=("--channel", "0"),
                       peer_args=("--channels", "2")) as stack:
        result = subprocess.run([*CLI, "check", "--transport", "verbs", "--rdma-ip", RXE_IP,
                                 "--peer", stack.peers[0].address],
                                capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[ ok ] RDMA device rxe0: port 1 4: ACTIVE" in result.stdout
    assert f"[ ok ] will use rxe0 port 1 GID index 1 ({RXE_IP})" in result.stdout
    assert "[ ok ] RLIMIT_MEMLOCK" in result.stdout
    assert "channel 1 of 2" in result.stdout
