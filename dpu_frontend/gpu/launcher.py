"""``dpu-frontend gpu-peer``: the host launcher of the persistent CUDA kernel.

It builds (or loads) ``libdpuf_peer.so``, allocates the region and the
mailbox area, writes the layout record, copies the token corpus to the GPU,
launches the kernel once and from then on answers only the control plane
(hello, welcome, stats): attach and detach are mailbox commands, and the
host CPU never touches a token. Where the region lives:

* ``--transport shm`` (a GPU machine without a NIC): the shm transport's file,
  mapped into the GPU with ``cudaHostRegister``; the daemon on the same host
  reads and writes it as it would RDMA.
* ``--transport verbs``: GPU memory (``cudaMalloc``), registered for RDMA with
  dma-buf or nvidia-peermem (``gpu/registration.py``), after checking the
  device's GPUDirect RDMA write ordering.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from pathlib import Path
from typing import Any

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu import registration
from dpu_frontend.gpu.options import GpuPeerConfig
from dpu_frontend.gpu.runtime import MODE_ECHO, MODE_REPLAY, Library, PeerParams, build
from dpu_frontend.peer.generator import corpus_tokens
from dpu_frontend.peer.kernel import PeerKernel, RegionAddress
from dpu_frontend.peer.server import PeerServer, TokenSource, serve_peer
from dpu_frontend.ring import Layout
from dpu_frontend.ring.layout import CHANNEL_SIZE, HEADER_SIZE
from dpu_frontend.ring.mailbox import KERNEL_BLOCK, KernelState, mailbox_area_size
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.transport.shm import map_file
from dpu_frontend.transport.verbs.resources import RdmaResources

log = logging.getLogger("dpu_frontend.gpu")

class CudaKernel(PeerKernel):
    """The persistent kernel of ``peer_kernel.cu`` behind the ``PeerKernel`` interface."""

    def __init__(self, config: GpuPeerConfig, corpus: list[list[int]],
                 eos_token_ids: tuple[int, ...]) -> None:
        self.config = config
        self._corpus = corpus
        self._eos = eos_token_ids
        self._lib: Library | None = None
        self._peer: int | None = None
        self._map: Any = None
        self._mailbox: AtomicMemory | None = None
        self._mailbox_buffer: Any = None
        self._keep: list[Any] = []  # ctypes arrays the library reads during create
        self._channels = 0
        self._failure: str | None = None

    def _library(self) -> Library:
        if self._lib is None:
            cfg = self.config
            path = cfg.library or build(cfg.build_dir, arch=cfg.cuda_arch, nvcc=cfg.nvcc)
            self._lib = Library(path)
        return self._lib

    def open(self, layout: Layout) -> RegionAddress:
        cfg, peer_cfg = self.config, self.config.peer
        lib = self._library()
        info = lib.device_info(cfg.device)
        log.info("GPU %d: %s, %d SMs, sm_%d%d, GPUDirect RDMA writes ordering %d",
                 cfg.device, info.name.decode(), info.sm_count, info.major, info.minor,
                 info.gdr_writes_ordering)
        region_host = None
        if peer_cfg.transport == "shm":
            self._map = map_file(str(peer_cfg.shm_path), layout.region_size, create=True)
            anchor = ctypes.c_char.from_buffer(self._map)
            self._keep.append(anchor)
            region_host = ctypes.addressof(anchor)
        else:
            registration.check_device(info)  # refuse before allocating anything
        tokens, starts = corpus_tokens(self._corpus, self._eos)
        params = self._params(layout, region_host, tokens, starts)
        handle = lib.lib.dpuf_peer_create(ctypes.byref(params))
        if not handle:
            raise StartupError(f"cannot create the CUDA peer: {lib.error()}")
        self._peer = handle
        header = layout.encode()
        lib.check(lib.lib.dpuf_peer_write_region(handle, 0, header, len(header)),
                  "writing the layout record")
        self._channels = len(layout.channels)
        size = mailbox_area_size(self._channels)
        pointer = lib.lib.dpuf_peer_mailbox(handle)
        self._mailbox_buffer = (ctypes.c_char * size).from_address(pointer)
        self._mailbox = AtomicMemory(self._mailbox_buffer)
        if peer_cfg.transport == "shm":
            return RegionAddress(path=str(peer_cfg.shm_path))
        return RegionAddress()

    def _params(self, layout: Layout, region_host: int | None, tokens: list[int],
                starts: list[int]) -> PeerParams:
        cfg, peer_cfg = self.config, self.config.peer
        header = layout.encode()
        descs = ctypes.create_string_buffer(header[HEADER_SIZE:],
                                            CHANNEL_SIZE * len(layout.channels))
        corpus = (ctypes.c_uint32 * max(1, len(tokens)))(*tokens)
        doc_starts = (ctypes.c_uint32 * max(1, len(starts)))(*starts)
        self._keep += [descs, corpus, doc_starts]
        per_record = min(ch.tokens_per_response for ch in layout.channels)
        if len(self._eos) > 8:
            raise StartupError(f"the tokenizer has {len(self._eos)} EOS ids; the CUDA peer "
                               "takes at most 8")
        eos = list(self._eos)
        return PeerParams(
            region_host=region_host, region_size=layout.region_size,
            channels=ctypes.cast(descs, ctypes.c_void_p), channel_count=len(layout.channels),
            mode=MODE_ECHO if peer_cfg.mode == "echo" else MODE_REPLAY,
            corpus=corpus, corpus_len=len(tokens), doc_starts=doc_starts, doc_count=len(starts),
            tokens_per_step=min(peer_cfg.tokens_per_step or per_record, per_record),
            eos=(ctypes.c_uint32 * 8)(*eos, *([0] * (8 - len(eos)))), eos_count=len(eos),
            engine_blocks=cfg.engine_blocks, step_ns=int(cfg.step_us * 1000),
            prefill_ns_per_token=int(cfg.prefill_us_per_token * 1000),
            heartbeat_ns=int(cfg.heartbeat_us * 1000), device=cfg.device, reserved=0,
        )

    def register(self, resources: RdmaResources, region: RegionAddress,
                 size: int) -> tuple[Any, int]:
        lib, handle = self._library(), self._handle()
        return registration.register_gpu_region(lib, handle, resources, size)

    @property
    def mailbox(self) -> AtomicMemory:
        if self._mailbox is None:
            raise RuntimeError("kernel not opened")
        return self._mailbox

    def _handle(self) -> int:
        if self._peer is None:
            raise RuntimeError("kernel not opened")
        return self._peer

    async def start(self) -> None:
        lib, handle = self._library(), self._handle()
        lib.check(lib.lib.dpuf_peer_launch(handle), "launching the persistent kernel")
        for _ in range(10_000):  # the kernel says RUNNING once its blocks are resident
            state = self.mailbox.load_acquire(KERNEL_BLOCK.offset("state"))
            if state == KernelState.RUNNING:
                return
            if self.failure() is not None:
                break
            await asyncio.sleep(0.001)
        raise StartupError(f"the persistent kernel did not start: {self.failure() or 'timeout'}")

    def failure(self) -> str | None:
        if self._failure is None and self._peer is not None and self._lib is not None:
            rc = self._lib.lib.dpuf_peer_poll(self._peer)
            if rc == 0:
                self._failure = "the persistent kernel returned"
            elif rc < 0:
                self._failure = f"the persistent kernel failed: {self._lib.error()}"
        return self._failure

    def channel_stats(self, channel: int) -> dict[str, Any]:
        block = self.mailbox
        return {"kernel_steps": block.load_acquire(KERNEL_BLOCK.offset("steps")),
                "kernel_heartbeats": block.load_acquire(KERNEL_BLOCK.offset("heartbeats"))}

    async def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Stop the kernel, free GPU and pinned memory, remove the shm file."""
        if self._peer is not None and self._lib is not None:
            if self._lib.lib.dpuf_peer_stop(self._peer, 5000) != 0:
                log.error("the persistent kernel did not stop: %s", self._lib.error())
            if self._mailbox is not None:
                self._mailbox.release()  # the pinned area goes with the peer
            self._mailbox = self._mailbox_buffer = None
            self._lib.lib.dpuf_peer_destroy(self._peer)
            self._peer = None
        self._keep.clear()
        if self._map is not None:
            self._map.close()
            self._map = None
            Path(self.config.peer.shm_path).unlink(missing_ok=True)


async def run_gpu_peer(config: GpuPeerConfig) -> int:
    """``dpu-frontend gpu-peer``: serve until SIGTERM/SIGINT."""
    source = TokenSource.load(config.peer, "dpu-frontend-gpu-peer")
    kernel = CudaKernel(config, source.corpus, source.eos_token_ids)
    return await serve_peer(PeerServer(config.peer, kernel, source.model))
