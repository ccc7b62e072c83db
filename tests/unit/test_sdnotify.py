"""The NOTIFY_SOCKET environment, as systemd sets it."""

from __future__ import annotations

import os

from dpu_frontend.sdnotify import Notifier


def test_not_under_systemd() -> None:
    notifier = Notifier.from_environment({})
    assert notifier.address is None and notifier.watchdog_s is None
    notifier.ready("nothing happens")


def test_abstract_socket_and_watchdog() -> None:
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": "@sd/notify",
                                          "WATCHDOG_USEC": "10000000",
                                          "WATCHDOG_PID": str(os.getpid())})
    assert notifier.address == "\0sd/notify"
    assert notifier.watchdog_s == 10.0


def test_watchdog_meant_for_another_process() -> None:
    notifier = Notifier.from_environment({"NOTIFY_SOCKET": "/run/notify",
                                          "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert notifier.watchdog_s is None
