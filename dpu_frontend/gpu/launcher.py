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

Structured output: the rings take automata of up to ``--max-automaton-bytes``, which
the kernel keeps in a pool of ``--automaton-pool-bytes`` of GPU memory and walks in its
replay and echo as the Python peer does; with no pool, the rings offer none.

The transport's provider decides which (``peer/region.py``); ``gpu/persistent.py``
does the rest, as for the scheduler inside the GPU.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import replace

from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.options import GpuPeerConfig
from dpu_frontend.gpu.persistent import PersistentKernel
from dpu_frontend.gpu.runtime import MODE_ECHO, MODE_REPLAY, PeerLibrary, PeerParams, build
from dpu_frontend.peer.generator import corpus_tokens
from dpu_frontend.peer.server import PeerServer, TokenSource, serve_peer
from dpu_frontend.ring import Layout
from dpu_frontend.ring.layout import CHANNEL_SIZE, HEADER_SIZE

log = logging.getLogger("dpu_frontend.gpu")


class CudaKernel(PersistentKernel[PeerLibrary]):
    """The persistent kernel of ``peer_kernel.cu``: the ring served from a token corpus."""

    what = "the persistent kernel"

    def __init__(self, config: GpuPeerConfig, corpus: list[list[int]],
                 eos_token_ids: tuple[int, ...], vocab_size: int) -> None:
        super().__init__(config.device)
        self.config = config
        self._corpus = corpus
        self._eos = eos_token_ids
        #: Structured output: automata are over this vocabulary (the tokenizer's).
        self._vocab_size = vocab_size

    def _load_library(self) -> PeerLibrary:
        cfg = self.config
        path = cfg.library or build(cfg.build_dir, arch=cfg.cuda_arch, nvcc=cfg.nvcc)
        return PeerLibrary.load(path)

    def _params(self, layout: Layout, region_host: int | None) -> PeerParams:
        cfg, peer_cfg = self.config, self.config.peer
        tokens, starts = corpus_tokens(self._corpus, self._eos)
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
        constrained = any(ch.constraints for ch in layout.channels)
        if constrained and self._vocab_size < 1:
            raise StartupError("the rings take structured output's automata, which are over "
                               "the tokenizer's vocabulary: the CUDA peer needs its size")
        return PeerParams(
            region_host=region_host, region_size=layout.region_size,
            channels=ctypes.cast(descs, ctypes.c_void_p), channel_count=len(layout.channels),
            mode=MODE_ECHO if peer_cfg.mode == "echo" else MODE_REPLAY,
            corpus=corpus, corpus_len=len(tokens), doc_starts=doc_starts, doc_count=len(starts),
            tokens_per_step=min(peer_cfg.tokens_per_step or per_record, per_record),
            eos=(ctypes.c_uint32 * 8)(*eos, *([0] * (8 - len(eos)))), eos_count=len(eos),
            engine_blocks=cfg.engine_blocks, step_ns=int(cfg.step_us * 1000),
            prefill_ns_per_token=int(cfg.prefill_us_per_token * 1000),
            heartbeat_ns=int(cfg.heartbeat_us * 1000), device=cfg.device,
            vocab=self._vocab_size,
            automaton_pool_bytes=cfg.automaton_pool_bytes if constrained else 0,
        )


def structured_output(config: GpuPeerConfig) -> GpuPeerConfig:
    """The rings' structured output (FEATURE_CONSTRAINTS): the kernel walks the automata
    within its pool; off without one (``--automaton-pool-bytes 0``)."""
    geometry = config.peer.geometry
    if not geometry.max_automaton_bytes or config.automaton_pool_bytes:
        return config
    log.info("structured output is off: --automaton-pool-bytes 0")
    return replace(config, peer=replace(config.peer, geometry=replace(
        geometry, max_automaton_bytes=0)))


async def run_gpu_peer(config: GpuPeerConfig) -> int:
    """``dpu-frontend gpu-peer``: serve until SIGTERM/SIGINT."""
    config = structured_output(config)
    source = TokenSource.load(config.peer, "dpu-frontend-gpu-peer")
    kernel = CudaKernel(config, source.corpus, source.eos_token_ids, source.vocab_size)
    return await serve_peer(PeerServer(config.peer, kernel, source.model))
