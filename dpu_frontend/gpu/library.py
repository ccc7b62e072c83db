"""The native libraries' ctypes bindings: one loader, and the host API that the
persistent kernels' libraries share.

Every library (``libdpuf_peer.so``, ``libdpuf_sched.so``, ``libdpuf_records.so``, and
the scheduler's core built for the host) is bound the same way: loaded with
ctypes, each function it is called by typed from one table (``api``), and a
failure explained by the library's own last-error function. A library of
another version (a stale ``--library``) is refused at load, naming the
function it lacks, instead of failing later in a call.

``PersistentLibrary`` is what both persistent kernels' libraries offer, each
under its own prefix (``dpuf_peer_*`` in peer_kernel.h, ``dpuf_model_*`` in
scheduler.h): the device query, create, the ring region (written; for a NIC,
its device address and a dma-buf), the mailbox area, launch, poll, stop and
destroy. ``persistent.PersistentKernel`` drives it.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Self

from dpu_frontend.errors import StartupError

#: A function's ctypes types: (argument types, result type).
Signature = tuple[tuple[Any, ...], Any]


def bind(path: Path, api: Mapping[str, Signature], what: str) -> ctypes.CDLL:
    """``path`` loaded and each function of ``api`` typed; ``StartupError`` says what is
    wrong (no such file, or a library without one of the functions)."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise StartupError(f"cannot load {what} {path}: {exc}") from exc
    for name, (args, restype) in api.items():
        try:
            fn = getattr(lib, name)
        except AttributeError as exc:
            raise StartupError(f"{path} is not {what} of this release: it has no {name}") from exc
        fn.argtypes, fn.restype = args, restype
    return lib


class CudaLibrary:
    """A loaded library and its last error. A subclass names itself (``what``), its
    last-error function, and extends ``api`` with the functions it calls."""

    #: What the messages call it.
    what: ClassVar[str] = "a CUDA library"
    #: The function that returns the calling thread's last failure (None: it has none).
    last_error: ClassVar[str | None] = None

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.lib = lib
        self.path = path

    @classmethod
    def api(cls) -> dict[str, Signature]:
        """Every function this binding calls, typed."""
        return {cls.last_error: ((), ctypes.c_char_p)} if cls.last_error else {}

    @classmethod
    def load(cls, path: Path) -> Self:
        return cls(bind(path, cls.api(), cls.what), path)

    def error(self) -> str:
        message = getattr(self.lib, self.last_error)() if self.last_error else None
        return message.decode(errors="replace") if message else "unknown error"

    def check(self, rc: int, what: str) -> None:
        """A call's result: anything but 0 raises with the library's reason."""
        if rc != 0:
            raise StartupError(f"{what}: {self.error()}")


class DeviceInfo(ctypes.Structure):
    """Mirror of ``dpuf_device_info`` (device_info.h; CI checks every offset)."""

    _fields_ = (
        ("name", ctypes.c_char * 96),
        ("sm_count", ctypes.c_int32),
        ("major", ctypes.c_int32),
        ("minor", ctypes.c_int32),
        ("gdr_writes_ordering", ctypes.c_int32),
        ("gdr_supported", ctypes.c_int32),
        ("dmabuf_supported", ctypes.c_int32),
        ("can_map_host", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
    )


class PersistentLibrary(CudaLibrary):
    """The host API of a persistent kernel's library, under ``prefix``. The result codes
    are the C API's (0 or a handle on success); ``check`` turns one into an error."""

    #: ``dpuf_peer`` or ``dpuf_model``: the common functions are ``{prefix}_launch``, ...
    prefix: ClassVar[str]
    #: The device query's name (its own: it takes a device, not a handle).
    device_query: ClassVar[str]
    #: The parameters ``{prefix}_create`` takes (a ctypes mirror of the header's).
    params: ClassVar[type[ctypes.Structure]]

    @classmethod
    def api(cls) -> dict[str, Signature]:
        vp, i32, u32, u64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_uint32, ctypes.c_uint64
        p, rc = cls.prefix, ctypes.c_int
        return {
            **super().api(),
            cls.device_query: ((i32, ctypes.POINTER(DeviceInfo)), rc),
            f"{p}_create": ((ctypes.POINTER(cls.params),), vp),
            f"{p}_write_region": ((vp, u64, ctypes.c_char_p, u64), rc),
            f"{p}_region_device_ptr": ((vp,), u64),
            f"{p}_dmabuf_fd": ((vp, ctypes.POINTER(i32), ctypes.POINTER(u64)), rc),
            f"{p}_mailbox": ((vp,), vp),
            f"{p}_launch": ((vp,), rc),
            f"{p}_poll": ((vp,), rc),
            f"{p}_stop": ((vp, u32), rc),
            f"{p}_destroy": ((vp,), None),
        }

    def _fn(self, name: str) -> Any:
        return getattr(self.lib, f"{self.prefix}_{name}")

    def device_info(self, device: int) -> DeviceInfo:
        info = DeviceInfo()
        self.check(getattr(self.lib, self.device_query)(device, ctypes.byref(info)), "device query")
        return info

    def create(self, params: ctypes.Structure) -> int:
        """The library's handle; 0 when it refused (the reason in ``error``)."""
        return int(self._fn("create")(ctypes.byref(params)) or 0)

    def write_region(self, handle: int, offset: int, data: bytes) -> int:
        return int(self._fn("write_region")(handle, offset, data, len(data)))

    def region_device_ptr(self, handle: int) -> int:
        """The region as the GPU addresses it (what nvidia-peermem registers)."""
        return int(self._fn("region_device_ptr")(handle))

    def dmabuf_fd(self, handle: int) -> tuple[int, int]:
        """A dma-buf fd of the region in GPU memory, and the region's offset in it; the
        caller closes the fd. ``StartupError`` where there is none."""
        fd, offset = ctypes.c_int32(-1), ctypes.c_uint64(0)
        self.check(self._fn("dmabuf_fd")(handle, ctypes.byref(fd), ctypes.byref(offset)),
                   "no dma-buf for the region")
        return fd.value, offset.value

    def mailbox(self, handle: int) -> int:
        """The host address of the mailbox area (pinned, mapped into the GPU)."""
        return int(self._fn("mailbox")(handle) or 0)

    def launch(self, handle: int) -> int:
        return int(self._fn("launch")(handle))

    def poll(self, handle: int) -> int:
        """1 while the kernels run, 0 once they returned, -1 on a fault."""
        return int(self._fn("poll")(handle))

    def stop(self, handle: int, timeout_ms: int) -> int:
        return int(self._fn("stop")(handle, timeout_ms))

    def destroy(self, handle: int) -> None:
        self._fn("destroy")(handle)
