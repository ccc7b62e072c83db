"""``dpu-frontend check`` on this machine (no RDMA device here; the VM test has one)."""

from __future__ import annotations

import subprocess

from dpu_frontend.softroce.processes import CLI
from dpu_frontend.transport.verbs.device import gid_table
from tests.stack import running_stack


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "check", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def test_a_good_shm_deployment_is_ready() -> None:
    with running_stack("shm", timeout=60, serve_args=("--channel", "0"),
                       peer_args=("--channels", "2")) as stack:
        result = check("--transport", "shm", "--peer", stack.peers[0].address)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[ ok ] tokenizer" in result.stdout
    assert f"[ ok ] GPU peer {stack.peers[0].address}: protocol v2.2, channel 1 of 2" in result.stdout
    assert "ready to serve" in result.stdout


def test_an_unreachable_peer_and_a_missing_rdma_device_are_reported() -> None:
    result = check("--transport", "verbs", "--peer", "127.0.0.1:9")
    out = result.stdout
    assert result.returncode == 1
    assert "[FAIL] GPU peer 127.0.0.1:9: cannot reach GPU peer" in out
    assert "fix: start the peer" in out
    if gid_table():  # a machine with a device (tests/rdma checks that case in the VM)
        assert "RDMA device" in out
    else:
        assert "[FAIL] no RDMA device; this kernel has" in out
        assert "fix: on a BlueField: load mlx5_ib" in out
        assert "2 problem(s) found" in out


def test_a_bad_setting_is_named() -> None:
    result = check("--transport", "shm", "--peer", "nohost")
    assert result.returncode == 2 and "peer address must be HOST:PORT" in result.stderr
