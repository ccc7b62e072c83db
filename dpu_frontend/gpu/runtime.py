"""Building the CUDA libraries, and the CUDA peer's ctypes binding.

Device code ships as package data beside the Python that owns its byte layouts:
``peer_kernel.cu`` (the persistent kernel and its host API, ``peer_kernel.h``)
here, the model engine's (record writer, scheduler) in ``dpu_frontend/model/device``;
both include the ring's device side from here. Each library is built with nvcc
on first use into a cache directory, named by a hash of its sources, so that an
upgrade rebuilds it and a second start does not. A deployment without nvcc passes a prebuilt
library (``--library``). Nothing here is imported by the daemon: CUDA is an
optional extra of the GPU side only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.library import PersistentLibrary

log = logging.getLogger("dpu_frontend.gpu")


@dataclass(frozen=True, slots=True)
class CudaSources:
    """One library's sources: ``main`` (the .cu, or a .c built for the host) and every
    file it includes, found in ``dirs`` (each a package's folder, searched in order and
    passed to the compiler as include paths). The owner of the device code declares it
    beside the code: the CUDA peer here, the model engine's in ``model/device``."""

    library: str
    main: str
    includes: tuple[str, ...]
    dirs: tuple[Path, ...]
    flags: tuple[str, ...] = ()

    def path(self, name: str) -> Path:
        for folder in self.dirs:
            if (folder / name).is_file():
                return folder / name
        raise StartupError(f"{name} of {self.library} is not in {', '.join(map(str, self.dirs))}")

    def files(self) -> list[Path]:
        return [self.path(name) for name in (self.main, *self.includes)]


def source_dir() -> Path:
    """This package's folder: the ring's device side and the CUDA peer."""
    return Path(str(files("dpu_frontend.gpu")))


#: The CUDA peer (``launcher.py``).
PEER_SOURCES = CudaSources("libdpuf_peer", "peer_kernel.cu",
                           ("peer_kernel.h", "device_info.h", "ring_device.cuh", "cuda_host.cuh",
                            "cuda_driver.cuh", "ring_protocol.h", "automaton_pool.cuh",
                            "automaton_walk.h"),
                           (source_dir(),))
#: The reference walk of a structured-output automaton (``automaton_walk.h``) built for the
#: host: the tests hold it to the Python walk (``automaton_walk.HostWalk``).
WALK_HOST = CudaSources("libdpuf_walk_host", "walk_host.c", ("automaton_walk.h",),
                        (source_dir(),))
#: Tensor parallelism's all-reduce over peer memory (``allreduce.h``) built for the host,
#: the ranks' blocks as threads: the tests hold it to the rank-order sum
#: (``allreduce.HostAllReduce``).
ALLREDUCE_HOST = CudaSources("libdpuf_allreduce_host", "allreduce_host.c",
                             ("allreduce.h", "peer_order.h"), (source_dir(),))
#: Tensor parallelism's step relay (``step_relay.h``: rank 0's scheduler handing each step
#: to the other ranks) built for the host, the ranks as threads (``step_relay.HostRelay``).
STEP_RELAY_HOST = CudaSources("libdpuf_relay_host", "step_relay_host.c",
                              ("step_relay.h", "peer_order.h"), (source_dir(),))
#: The same all-reduce on the GPU (``allreduce.PeerMemoryLibrary``).
ALLREDUCE = CudaSources("libdpuf_allreduce", "allreduce.cu",
                        ("allreduce.h", "peer_order.h", "cuda_host.cuh"), (source_dir(),))


def default_build_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "dpu-frontend"


def find_nvcc(nvcc: str | None = None) -> str:
    candidates = [nvcc] if nvcc else [
        shutil.which("nvcc"),
        *(str(Path(home) / "bin" / "nvcc") for home in
          (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if home),
    ]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return candidate
    raise StartupError("nvcc not found: install the CUDA toolkit, set CUDA_HOME, pass --nvcc, "
                       "or pass a prebuilt --library")


def build_command(nvcc: str, arch: str, output: Path, sources: CudaSources) -> list[str]:
    rdc = [f for f in sources.flags if not f.startswith("-l")]
    libs = [f for f in sources.flags if f.startswith("-l")]
    return [nvcc, "-O3", "-std=c++17", f"-arch={arch}", *rdc, "-Xcompiler", "-fPIC", "-shared",
            *(f"-I{d}" for d in sources.dirs), str(sources.path(sources.main)), "-o", str(output),
            *libs]


def host_build_command(output: Path, sources: CudaSources) -> list[str]:
    """A C library for the host (``sources.main`` a .c)."""
    compiler = next((cc for cc in ("cc", "gcc", "clang") if shutil.which(cc)), None)
    if compiler is None:
        raise StartupError("no C compiler: deploy/dev.sh setup installs gcc")
    return [compiler, "-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
            "-fvisibility=hidden", *(f"-I{d}" for d in sources.dirs),
            str(sources.path(sources.main)), "-o", str(output)]


def build(build_dir: Path, sources: CudaSources = PEER_SOURCES, *, arch: str = "sm_90",
          nvcc: str | None = None) -> Path:
    """The library of ``sources`` for ``arch``, built now unless already cached (named by
    a hash of every source, so an upgrade rebuilds it); a .c main is built for the host
    with the C compiler (``arch`` names the cache entry only)."""
    digest = hashlib.sha256(" ".join((arch, *sources.flags)).encode())
    for path in sources.files():
        digest.update(path.read_bytes())
    output = build_dir / f"{sources.library}-{arch}-{digest.hexdigest()[:16]}.so"
    if output.is_file():
        return output
    build_dir.mkdir(parents=True, exist_ok=True)
    partial = output.with_suffix(f".{os.getpid()}.tmp")
    command = (host_build_command(partial, sources) if sources.main.endswith(".c")
               else build_command(find_nvcc(nvcc), arch, partial, sources))
    log.info("building %s: %s", sources.library, " ".join(command))
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise StartupError(f"{command[0]} failed ({done.returncode}):\n{done.stderr.strip()}")
    partial.replace(output)  # atomic: a concurrent start never loads a half-written file
    return output


def build_host(build_dir: Path, sources: CudaSources) -> Path:
    """The host build of a C library that tests load (``sources.main`` a .c): a failed
    build is a RuntimeError there, not a StartupError, as no start-up fails."""
    try:
        return build(build_dir, sources, arch="host")
    except StartupError as exc:
        raise RuntimeError(str(exc)) from exc


class PeerParams(ctypes.Structure):
    """Mirror of ``dpuf_peer_params`` (CI checks every offset against the header)."""

    _fields_ = (
        ("region_host", ctypes.c_void_p),
        ("region_size", ctypes.c_uint64),
        ("channels", ctypes.c_void_p),
        ("channel_count", ctypes.c_uint32),
        ("mode", ctypes.c_uint32),
        ("corpus", ctypes.POINTER(ctypes.c_uint32)),
        ("corpus_len", ctypes.c_uint64),
        ("doc_starts", ctypes.POINTER(ctypes.c_uint32)),
        ("doc_count", ctypes.c_uint32),
        ("tokens_per_step", ctypes.c_uint32),
        ("eos", ctypes.c_uint32 * 8),
        ("eos_count", ctypes.c_uint32),
        ("engine_blocks", ctypes.c_uint32),
        ("step_ns", ctypes.c_uint64),
        ("prefill_ns_per_token", ctypes.c_uint64),
        ("heartbeat_ns", ctypes.c_uint64),
        ("device", ctypes.c_int32),
        ("vocab", ctypes.c_uint32),
        ("automaton_pool_bytes", ctypes.c_uint64),
    )


MODE_REPLAY = 0
MODE_ECHO = 1


class PeerLibrary(PersistentLibrary):
    """``libdpuf_peer.so`` (peer_kernel.h): the persistent-kernel API, ``dpuf_peer_*``."""

    what = "the CUDA peer library"
    last_error = "dpuf_last_error"
    prefix = "dpuf_peer"
    device_query = "dpuf_device_info_get"
    params = PeerParams
