"""The shipped deployment files agree with the code: config example, dashboard, units."""

from __future__ import annotations

import json
import re
from pathlib import Path

from dpu_frontend.metrics import Metrics
from dpu_frontend.settings import build

ROOT = Path(__file__).parent.parent.parent


def test_the_bluefield_config_example_is_valid() -> None:
    config, logging_ = build({}, config_path=ROOT / "deploy/bluefield/config.toml", env={})
    assert config.transport == "verbs" and config.rdma.ip == "10.10.0.2"
    assert logging_ == {"log_level": "INFO", "log_format": "json"}


def test_the_dashboard_only_queries_metrics_the_daemon_exports() -> None:
    exported = set()
    for family in Metrics().registry.collect():
        exported |= {sample.name for sample in family.samples}
    exported |= {"dpu_frontend_num_requests_running", "dpu_frontend_num_requests_waiting",
                 "dpu_frontend_ring_occupancy", "dpu_frontend_peer_up"}  # scrape-time gauges
    labelled = {"dpu_frontend_requests_total", "dpu_frontend_aborted_requests_total",
                "dpu_frontend_rdma_operations_total", "dpu_frontend_rdma_errors_total",
                "dpu_frontend_peer_reconnects_total"}  # no sample until a label set is used
    dashboard = json.loads((ROOT / "deploy/grafana/dpu-frontend.json").read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"dpu_frontend_\w+", target["expr"])}
    assert queried and queried <= exported | labelled, queried - exported - labelled


def test_unit_stop_timeout_exceeds_the_drain() -> None:
    unit = (ROOT / "systemd/dpu-frontend.service").read_text()
    stop = int(re.search(r"^TimeoutStopSec=(\d+)", unit, re.MULTILINE).group(1))  # type: ignore[union-attr]
    assert stop > 30 + 5  # default drain_timeout_s + the close grace
    assert "LimitMEMLOCK=infinity" in unit and "Type=notify" in unit and "WatchdogSec=" in unit
