"""Fixtures the unit tests share."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest


@pytest.fixture
def restored_root_logger() -> Iterator[None]:
    """For tests that run ``cli.main``, which configures the root logger (onto the
    captured stderr): its handlers and level put back after the test."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
