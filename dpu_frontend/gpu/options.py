"""The CUDA peer's settings (``dpu-frontend gpu-peer``), each field with its flag's help.

No CUDA here, and nothing is loaded: the CLI parses and validates these on any
machine (a bad flag is a usage error before a GPU is touched), and CI tests them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dpu_frontend.config import PeerConfig
from dpu_frontend.flags import about, flat
from dpu_frontend.gpu.runtime import default_build_dir
from dpu_frontend.ring import Geometry
from dpu_frontend.ring.layout import AUTOMATON_HEADER_SIZE

#: GPU-like defaults: a decode step emits one record per running sequence, so a
#: channel runs up to 1024 sequences with a response ring of two steps of them.
#: The kernel's token source has no distribution to give log probabilities of: 64-byte
#: slots of plain ids, FEATURE_LOGPROBS off (a request asking for them gets a 400).
#: Its replay walks structured output's automata of up to 4 MiB (a regex, a choice, a
#: small schema over Qwen3's vocabulary; larger ones get the daemon's 400), beside the
#: longest prompt in the arena.
GPU_GEOMETRY = Geometry(max_sequences=1024, resp_slots=2048, max_prompt_tokens=32768,
                        arena_bytes=8 << 20, resp_slot_size=64, logprobs=False,
                        max_automaton_bytes=4 << 20)


def automaton_pool_need(max_automaton_bytes: int) -> int:
    """The pool bytes the largest automaton of ``max_automaton_bytes`` can take in the
    kernel: its arrays in whole 128-byte lines, and a distance for each of at most
    ``(bytes - header) / 12`` states (peer_kernel.cu's ``automaton_pool_need``)."""
    if max_automaton_bytes < AUTOMATON_HEADER_SIZE:
        return 0
    body = max_automaton_bytes - AUTOMATON_HEADER_SIZE
    lines = -(-(body // 4) // 32) + -(-(body // 12) // 32)
    return lines * 128


@dataclass(frozen=True, slots=True)
class GpuPeerConfig:
    """The CUDA peer: the shared peer settings, and how the kernel is built and run."""

    peer: PeerConfig = field(default_factory=PeerConfig, metadata=flat())
    device: int = field(default=0, metadata=about("CUDA device ordinal"))
    engine_blocks: int = field(default=0, metadata=about(
        "blocks of the persistent kernel, 0: one per SM"))
    step_us: float = field(default=0.0, metadata=about(
        "minimum engine step in microseconds (a decode step's duration), 0: no pacing"))
    # Simulated: the tests of the heartbeat give a prompt a cost.
    prefill_us_per_token: float = field(default=0.0, metadata=about(
        "simulated prefill cost per prompt token, microseconds"))
    heartbeat_us: float = field(default=100.0, metadata=about(
        "period of the heartbeat warp, microseconds"))
    automaton_pool_bytes: int = field(default=64 << 20, metadata=about(
        "GPU memory for structured output's automata, each with its states' distances; "
        "at least what the largest (--max-automaton-bytes) takes, 0: no structured output "
        "(--max-automaton-bytes 0 also gives the arena its room back)"))
    library: Path | None = field(default=None, metadata=about(
        "a prebuilt libdpuf_peer.so", none="build"))
    build_dir: Path = field(default_factory=default_build_dir, metadata=about(
        "where nvcc's build is cached"))
    cuda_arch: str = field(default="sm_90", metadata=about("nvcc -arch"))
    nvcc: str | None = field(default=None, metadata=about(
        "the nvcc to build with", none="PATH, then CUDA_HOME"))

    def __post_init__(self) -> None:
        if self.device < 0 or self.engine_blocks < 0:
            raise ValueError("device and engine_blocks must be >= 0")
        if self.step_us < 0 or self.prefill_us_per_token < 0:
            raise ValueError("step_us and prefill_us_per_token must be >= 0")
        if not 1 <= self.heartbeat_us <= 100_000:
            raise ValueError("heartbeat_us must be in [1, 100000]")
        largest = self.peer.geometry.max_automaton_bytes
        if self.automaton_pool_bytes < 0:
            raise ValueError("automaton_pool_bytes must be >= 0")
        if largest and self.automaton_pool_bytes and (
                self.automaton_pool_bytes < automaton_pool_need(largest)):
            raise ValueError(f"automaton_pool_bytes ({self.automaton_pool_bytes}) must hold the "
                             f"largest automaton, {automaton_pool_need(largest)} bytes with its "
                             f"distances for --max-automaton-bytes {largest} (or 0: no "
                             "structured output)")
