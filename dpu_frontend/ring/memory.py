"""Loads and stores on shared ring memory with real acquire/release ordering.

The daemon runs on the DPU's Arm cores, whose memory model lets plain stores
become visible to another agent out of program order (and plain loads be
satisfied out of order). Wherever a CPU plays one side of the ring (the
``shm`` transport, the reference peer, the GPU-side launcher's mailbox), the
validity markers therefore go through real atomics:

* a marker or counter is stored with a **release** store (``stlr`` on Arm):
  every earlier store of this thread (a record body, a prompt) is visible
  before it;
* a marker or counter is loaded with an **acquire** load (``ldar``): no later
  load (a body, a prompt) is satisfied before it;
* copies that stand in for one RDMA operation are separated by fences.

They come from libatomic (``__atomic_load_8``, ``__atomic_store_8``,
``atomic_thread_fence``) through ctypes: the GCC runtime every distribution
ships (Debian/Ubuntu ``libatomic1``), so no compiler is needed at install
time. On x86-64, whose total store order already gives all of this, a host
without libatomic falls back to plain single-word accesses; on any other
architecture a missing libatomic is an error, never a silent downgrade.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import struct
from collections.abc import Callable
from typing import Any

# C11 memory orders (the values of GCC's __ATOMIC_* constants).
_ACQUIRE = 2
_RELEASE = 3
_SEQ_CST = 5

_U64 = struct.Struct("<Q")


def _load_libatomic() -> Any:
    for name in (ctypes.util.find_library("atomic"), "libatomic.so.1"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        # getattr: inside a class body the dunder names would be mangled.
        load, store = getattr(lib, "__atomic_load_8"), getattr(lib, "__atomic_store_8")
        load.argtypes, load.restype = (ctypes.c_void_p, ctypes.c_int), ctypes.c_uint64
        store.argtypes, store.restype = (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int), None
        lib.atomic_thread_fence.argtypes = (ctypes.c_int,)
        lib.atomic_thread_fence.restype = None
        return lib
    if platform.machine() in ("x86_64", "AMD64"):
        return None
    raise RuntimeError(
        f"libatomic is missing: on {platform.machine()} the ring needs real acquire/release "
        "barriers (install libatomic1)"
    )


_LIB = _load_libatomic()
#: Whether real barriers are in use (False only on an x86-64 host without libatomic).
REAL_BARRIERS = _LIB is not None


def _noop(_order: int) -> None:
    return None


_fence: Callable[[int], None] = _LIB.atomic_thread_fence if _LIB is not None else _noop
_load8: Callable[[int, int], int] | None = getattr(_LIB, "__atomic_load_8", None)
_store8: Callable[[int, int, int], None] | None = getattr(_LIB, "__atomic_store_8", None)


def fence_release() -> None:
    """Order every earlier load and store before every later store."""
    _fence(_RELEASE)


def fence_acquire() -> None:
    """Order every earlier load before every later load and store."""
    _fence(_ACQUIRE)


def fence_full() -> None:
    _fence(_SEQ_CST)


class AtomicMemory:
    """A writable buffer (an mmap, a bytearray, pinned host memory) with single-word
    acquire loads and release stores at 8-byte aligned offsets, and plain copies."""

    def __init__(self, buffer: Any) -> None:
        self.view = memoryview(buffer).cast("B")
        if self.view.readonly:
            raise ValueError("ring memory must be writable")
        # The buffer export also keeps the buffer from being unmapped under us.
        self._anchor: ctypes.c_char | None = ctypes.c_char.from_buffer(buffer)
        self._base = ctypes.addressof(self._anchor)
        if self._base % 8:
            # libatomic would take a lock for a misaligned word: not atomic for the
            # other side of the ring.
            raise ValueError("ring memory must start on an 8-byte boundary")
        self._words = self.view.cast("Q") if len(self.view) % 8 == 0 else None

    def __len__(self) -> int:
        return len(self.view)

    @property
    def address(self) -> int:
        """The buffer's virtual address (for memory registration)."""
        return self._base

    def load_acquire(self, offset: int) -> int:
        self._check_word(offset)
        if _load8 is not None:
            return int(_load8(self._base + offset, _ACQUIRE))
        return int(_U64.unpack_from(self.view, offset)[0])

    def store_release(self, offset: int, value: int) -> None:
        self._check_word(offset)
        if _store8 is not None:
            _store8(self._base + offset, value, _RELEASE)
        elif self._words is not None:
            self._words[offset // 8] = value  # one aligned 8-byte store: TSO orders it
        else:
            raise ValueError("word access on a buffer whose size is not a multiple of 8")

    def read(self, offset: int, length: int) -> bytes:
        return bytes(self.view[offset:offset + length])

    def write(self, offset: int, data: bytes | memoryview) -> None:
        self.view[offset:offset + len(data)] = data

    def _check_word(self, offset: int) -> None:
        if offset % 8 or not 0 <= offset <= len(self.view) - 8:
            raise ValueError(f"word access at {offset} is unaligned or outside the buffer")

    def release(self) -> None:
        """Drop the buffer exports (before the buffer is unmapped)."""
        self._anchor = None
        if self._words is not None:
            self._words.release()
        self.view.release()
