"""pyverbs across rdma-core versions.

pyverbs comes from the distribution (Debian 12 ships rdma-core 44; DOCA and
newer distributions ship 50+). Between them ``pyverbs.enums`` became
``pyverbs.libibverbs_enums``. Everything else imports pyverbs through here,
and ``available()`` tells whether it can be imported at all.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

try:
    from pyverbs import libibverbs_enums as _enums  # rdma-core >= 47
except ImportError:  # pragma: no cover - depends on the installed rdma-core
    try:
        from pyverbs import enums as _enums  # rdma-core 44 (Debian 12)
    except ImportError:
        _enums = None

IMPORT_ERROR: str | None = None
pyverbs_modules: dict[str, ModuleType] = {}
try:
    from pyverbs import addr, cq, device, mr, pd, qp, wr
    from pyverbs import pyverbs_error as errors

    pyverbs_modules = {"addr": addr, "cq": cq, "device": device, "mr": mr, "pd": pd,
                       "qp": qp, "wr": wr, "errors": errors}
except ImportError as exc:  # pragma: no cover - depends on the host
    IMPORT_ERROR = f"pyverbs is not importable ({exc}); install the distribution's python3-pyverbs"


def available() -> bool:
    return _enums is not None and IMPORT_ERROR is None


def status_name(status: int) -> str:
    """``IBV_WC_REM_ACCESS_ERR`` for a completion status number."""
    if _enums is None:
        return str(status)
    for name in dir(_enums):
        is_status = name.endswith("_ERR") or name == "IBV_WC_SUCCESS"
        if name.startswith("IBV_WC_") and is_status and getattr(_enums, name) == status:
            return name
    return f"status {status}"


def enum(name: str) -> Any:
    """One ibv_* constant by name, from whichever enums module exists."""
    if _enums is None:
        raise RuntimeError(IMPORT_ERROR or "pyverbs is not available")
    return getattr(_enums, name)


def module(name: str) -> Any:
    if IMPORT_ERROR is not None:
        raise RuntimeError(IMPORT_ERROR)
    return pyverbs_modules[name]
