"""``dpu-frontend model-peer``: the model engine behind the ring, host-scheduled.

The host process loads the model on the GPU, then serves the ring protocol
with the host-driven kernel loop (``dpu_frontend.peer.reference``): each tick
it takes the committed request records of every channel and runs one engine
step over all their sequences. The step's records, one per sequence that
drew a token, are written by the GPU (``--records gpu``, the default: the
record writer kernel behind the sampler, ``dpu_frontend.model.publish``) or
by this loop (``--records host``, the baseline). The daemon in front of it
is unchanged.

``--scheduler gpu`` (``model/gpu_scheduler.py``) checks, before the model loads,
everything its region needs that can refuse: the scheduler's library, and under
verbs an RDMA device, the GPU's GPUDirect RDMA and a way to register its memory.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from dpu_frontend import __version__
from dpu_frontend.config import PeerConfig
from dpu_frontend.errors import StartupError
from dpu_frontend.gpu.persistent import check_region
from dpu_frontend.gpu.runtime import build, default_build_dir
from dpu_frontend.model import gguf_checkpoint
from dpu_frontend.model.config import ModelConfig
from dpu_frontend.model.device import RECORDS, SCHEDULER
from dpu_frontend.model.device.sched_core import SchedulerLibrary
from dpu_frontend.model.engine import ModelEngine
from dpu_frontend.model.gpu_scheduler import GpuSchedulerKernel, sampler_reserve
from dpu_frontend.model.options import ModelPeerOptions
from dpu_frontend.model.publish import CudaRecordBackend, RingRecords
from dpu_frontend.model.runner import ModelRunner
from dpu_frontend.model.source import EngineHub, ModelSource, RecordsFactory, RingSource
from dpu_frontend.peer.kernel import PeerKernel
from dpu_frontend.peer.reference import RecordSpace, ReferenceKernel, SequenceSource
from dpu_frontend.peer.region import region_for
from dpu_frontend.peer.server import PeerServer, serve_peer
from dpu_frontend.ring import Layout
from dpu_frontend.ring.memory import AtomicMemory
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.tokenizer import Vocabulary

log = logging.getLogger("dpu_frontend.model")


def model_config(options: ModelPeerOptions) -> ModelConfig:
    if options.config is not None:
        return ModelConfig.load(options.config)
    if options.runner.weights is not None:
        if options.runner.weights.suffix == ".gguf":
            return gguf_checkpoint.load_config(options.runner.weights)
        return ModelConfig.load(options.runner.weights)
    return ModelConfig.default()


async def run_model_peer(peer: PeerConfig, options: ModelPeerOptions) -> int:
    config = model_config(options)
    peer = structured_output(peer, options)
    vocab = Vocabulary.load(peer.tokenizer or default_tokenizer_dir())
    if vocab.tokenizer.get_vocab_size() > config.vocab_size:
        raise StartupError(f"the tokenizer has {vocab.tokenizer.get_vocab_size()} ids, the model "
                         f"{config.vocab_size}")
    # Before the model: the load takes minutes at deployable sizes, a refusal seconds.
    library = scheduler_library(peer, options) if options.scheduler == "gpu" else None
    runner = ModelRunner(config, replace(options.runner,
                                         vocab_limit=vocab.tokenizer.get_vocab_size()))
    eos = tuple(dict.fromkeys(config.eos_token_ids + vocab.eos_token_ids))
    model: dict[str, Any] = {"eos_token_ids": list(eos), "mode": "model",
                             "scheduler": options.scheduler,
                             "peer": f"dpu-frontend-model-peer {__version__}"}
    if library is not None:
        return await serve_peer(PeerServer(peer, gpu_kernel(options, runner, eos, library), model))
    runner.load()  # weights, KV cache, graphs: before the ready line
    engine = ModelEngine(config, runner, options.engine)
    gpu_records = options.records == "gpu"
    hub = EngineHub(engine, records_factory(options, engine) if gpu_records else None)

    def source(channel: int, space: RecordSpace) -> SequenceSource:
        return RingSource(hub, channel) if gpu_records else ModelSource(hub, space)

    kernel = ReferenceKernel(peer, [], eos, vocab_size=vocab.tokenizer.get_vocab_size(),
                             sources=source, between_steps=hub.step, stats=hub.stats,
                             opened=hub.opened, closing=hub.closed)
    log.info("model peer: %d layers, hidden %d, %s, weights %s, records written by the %s",
             config.num_layers, config.hidden_size, options.runner.dtype,
             options.runner.weights or "random", options.records)
    return await serve_peer(PeerServer(peer, kernel, model))


def structured_output(peer: PeerConfig, options: ModelPeerOptions) -> PeerConfig:
    """The rings' structured output (FEATURE_CONSTRAINTS): the sampler walks the
    automata (either scheduler), each within the automaton pool; off without one."""
    geometry = peer.geometry
    if not geometry.max_automaton_bytes:
        return peer
    pool = options.runner.automaton_pool_bytes
    if not pool:
        log.info("structured output is off: --automaton-pool-bytes 0")
        return replace(peer, geometry=replace(geometry, max_automaton_bytes=0))
    if geometry.max_automaton_bytes > pool:
        raise StartupError(f"--max-automaton-bytes {geometry.max_automaton_bytes} is more than "
                           f"the automaton pool holds (--automaton-pool-bytes {pool})")
    return peer


def cuda_arch(device: int) -> str:
    """What nvcc builds for: the device's compute capability (``sm_90``)."""
    import torch  # the model peer's stack; imported where a build needs it

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def scheduler_library(peer: PeerConfig, options: ModelPeerOptions) -> SchedulerLibrary:
    """``--scheduler gpu``, before the model loads: the scheduler's library (built now with
    nvcc unless ``--scheduler-library``), and what the transport's region needs of this
    machine (``gpu.persistent.check_region``): under verbs an RDMA device, the GPU's
    GPUDirect RDMA with ordered writes, and dma-buf or nvidia-peermem to register its
    memory. Each missing piece refuses the start here, with the reason."""
    device = options.runner.device
    path = options.scheduler_library or build(default_build_dir(), SCHEDULER,
                                              arch=cuda_arch(device))
    library = SchedulerLibrary.load(path)
    check_region(region_for(peer), library, device)
    return library


def gpu_kernel(options: ModelPeerOptions, runner: ModelRunner, eos: tuple[int, ...],
               library: SchedulerLibrary) -> PeerKernel:
    """``--scheduler gpu``: the model loaded with its graphs kept for device launch and
    the sampler graphs captured, before the ready line, so that either failing fails
    the start."""
    runner.load(keep_graphs=True, reserve=sampler_reserve(runner))
    kernel = GpuSchedulerKernel(runner, eos, library,
                                max_batched_tokens=options.engine.max_batched_tokens)
    kernel.capture()
    log.info("model peer: %d layers, hidden %d, %s, weights %s, scheduler on the GPU",
             runner.config.num_layers, runner.config.hidden_size, options.runner.dtype,
             options.runner.weights or "random")
    return kernel


def records_factory(options: ModelPeerOptions, engine: ModelEngine) -> RecordsFactory:
    """The GPU's record writer on the peer's region, built now (nvcc) unless
    prebuilt, so that a missing toolkit fails before the ready line."""
    device = options.runner.device
    library = options.records_library or build(default_build_dir(), RECORDS,
                                               arch=cuda_arch(device))
    slots = engine.runner.options.max_seqs

    def make(memory: AtomicMemory, layout: Layout) -> RingRecords:
        backend = CudaRecordBackend(library, layout, memory, slots, tuple(sorted(engine.eos)),
                                    device)
        return RingRecords(backend, layout, memory, slots)

    return make
