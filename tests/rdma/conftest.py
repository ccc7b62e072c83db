"""RDMA tests need a real RDMA device: soft-RoCE ``rxe0`` at 10.223.0.1.

Without one they skip, unless DPU_FRONTEND_REQUIRE_RDMA=1 (the test command
sets it, and CI runs the test command): then a missing device is a failure.
"""

from __future__ import annotations

import os

import pytest

from dpu_frontend.errors import StartupError
from dpu_frontend.softroce.harness import RXE_IP
from dpu_frontend.transport.verbs import compat
from dpu_frontend.transport.verbs.device import resolve


@pytest.fixture(scope="session", autouse=True)
def rdma_device() -> None:
    problem = None
    if not compat.available():
        problem = compat.IMPORT_ERROR or "pyverbs is not importable"
    else:
        try:
            resolve(None, RXE_IP)
        except StartupError as exc:
            problem = str(exc)
    if problem is None:
        return
    if os.environ.get("DPU_FRONTEND_REQUIRE_RDMA") == "1":
        pytest.fail(f"RDMA tests required but no device: {problem}")
    pytest.skip(f"no soft-RoCE device: {problem} (run them with: dpu-frontend softroce -- pytest -m rdma)")
