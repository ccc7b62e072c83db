"""``dpu-frontend``: serve, check, peer, gpu-peer, peer-stats, demo, softroce.

The CLI is the edge where configuration is built: flags become one frozen
config object, validated once; a bad value exits 2 with its message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvloop

from dpu_frontend import __version__
from dpu_frontend.check import run_check
from dpu_frontend.config import PeerAddress, PeerConfig, RdmaConfig, ServeConfig
from dpu_frontend.control.stats import peer_stats
from dpu_frontend.daemon import serve
from dpu_frontend.errors import DpuFrontendError
from dpu_frontend.gpu.launcher import (
    GPU_GEOMETRY,
    add_gpu_arguments,
    gpu_peer_config,
    run_gpu_peer,
)
from dpu_frontend.logs import configure
from dpu_frontend.peer.server import run_peer
from dpu_frontend.ring import Geometry
from dpu_frontend.settings import DEFAULT_PATH as DEFAULT_CONFIG
from dpu_frontend.settings import PARSERS, build
from dpu_frontend.softroce.demo import run_demo
from dpu_frontend.softroce.harness import run_cli
from dpu_frontend.workers import supervise

log = logging.getLogger("dpu_frontend")

DEFAULT_PEER_PORT = 18515


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--transport", choices=("verbs", "shm"), default="verbs",
                        help="verbs: RDMA through pyverbs (product); shm: shared-memory twin")
    parser.add_argument("--rdma-device", default=None,
                        help="RDMA device name (rxe0, mlx5_2); default: the one matching "
                             "--rdma-ip, or the only device")
    parser.add_argument("--rdma-ip", default=None,
                        help="RoCE address whose GID to use (selects device and GID index)")
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="tokenizer.json or a directory holding it "
                             "(default: the bundled Qwen3 tokenizer)")
    parser.add_argument("--log-level", default="INFO",
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"))


def _serve_settings(serve: argparse.ArgumentParser) -> None:
    """Every flag defaults to None: only flags given on the command line override."""
    def add(flag: str, key: str, help: str, **kwargs: Any) -> None:
        serve.add_argument(flag, dest=key, default=None, help=f"{help} [{key}]", **kwargs)

    add("--transport", "transport", "verbs (RDMA, the product) or shm (shared-memory twin); "
        "default verbs", choices=("verbs", "shm"))
    add("--rdma-device", "rdma_device", "RDMA device name (rxe0, mlx5_2); default: the one "
        "matching --rdma-ip, or the only device")
    add("--rdma-ip", "rdma_ip", "RoCE address whose GID to use (selects device and GID index)")
    add("--peer", "peers", f"GPU peer control address HOST:PORT; repeat for several GPUs "
        f"(default 127.0.0.1:{DEFAULT_PEER_PORT})", action="append")
    add("--host", "host", "HTTP listen address (default 127.0.0.1)")
    add("--port", "port", "HTTP listen port, 0 for any (default 8000)", type=int)
    add("--model-name", "model_name", "the model name clients send (default qwen3)")
    add("--tokenizer", "tokenizer", "tokenizer.json or a directory holding it "
        "(default: the bundled Qwen3 tokenizer)", type=Path)
    add("--chat-template", "chat_template", "a .jinja chat template (default: the tokenizer "
        "config's)", type=Path)
    add("--max-model-len", "max_model_len", "context length (default: the tokenizer config's)",
        type=int)
    add("--channel", "channel", "the peers' ring pair to claim, -1 for any free one (default -1)",
        type=int)
    add("--poll-interval", "poll_interval_s", "seconds between response-ring polls while "
        "requests are in flight (default 0.0005)", type=float)
    add("--peer-timeout", "peer_timeout_s", "seconds without a heartbeat or an RDMA completion "
        "before a peer is failed and its streams end with an error (default 1)", type=float)
    add("--reconnect-max", "reconnect_max_s", "longest wait between reconnection attempts, "
        "seconds (default 5)", type=float)
    add("--max-queued-requests", "max_queued_requests", "requests waiting for each peer's "
        "request ring before 429 (default 1024)", type=int)
    add("--max-queued-prompt-tokens", "max_queued_prompt_tokens", "prompt tokens waiting for "
        "each peer's request ring before 429 (default 1048576)", type=int)
    add("--stream-buffer-records", "stream_buffer_records", "response records buffered for one "
        "slow client before it is cut off (default 4096)", type=int)
    add("--drain-timeout", "drain_timeout_s", "seconds open requests get to finish on SIGTERM "
        "(default 30)", type=float)
    add("--tokenizer-threads", "tokenizer_threads", "threads tokenizing prompts off the event "
        "loop (default 2)", type=int)
    add("--workers", "workers", "worker processes sharing the HTTP port, each with its own "
        "channel to every peer (default 1)", type=int)
    serve.add_argument("--worker-index", dest="worker_index", type=int, default=None,
                       help=argparse.SUPPRESS)  # set by the supervisor
    serve.add_argument("--metrics-dir", dest="metrics_dir", type=Path, default=None,
                       help=argparse.SUPPRESS)  # set by the supervisor
    add("--log-level", "log_level", "DEBUG, INFO, WARNING or ERROR (default INFO)",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    add("--log-format", "log_format", "text or json (JSON lines); default text",
        choices=("text", "json"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpu-frontend", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dpu-frontend {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="run the daemon (OpenAI-compatible HTTP in front of GPU peers)",
        description="Settings come from the [serve] table of the config file, then "
                    "DPU_FRONTEND_<SETTING> environment variables (e.g. DPU_FRONTEND_PORT), then "
                    "these flags; each flag names its setting in brackets.")
    serve.add_argument("--config", type=Path, default=None,
                       help=f"TOML file (default {DEFAULT_CONFIG} if it exists)")
    _serve_settings(serve)

    check = sub.add_parser("check", help="diagnose what a deployment needs (RDMA, memlock, "
                                         "tokenizer, GPU peers); non-zero exit on a problem")
    check.add_argument("--config", type=Path, default=None,
                       help=f"TOML file (default {DEFAULT_CONFIG} if it exists)")
    _serve_settings(check)
    peer = sub.add_parser("peer", help="run the reference GPU peer")
    _peer_settings(peer, Geometry())
    peer.add_argument("--tokens-per-s", type=float, default=50.0,
                      help="per-sequence generation rate (0: as fast as the ring takes)")
    peer.add_argument("--tick", type=float, default=0.001, help="engine step period, seconds")

    gpu = sub.add_parser("gpu-peer", help="run the CUDA peer: the ring served by a persistent "
                                          "GPU kernel (needs a CUDA GPU and nvcc)")
    _peer_settings(gpu, GPU_GEOMETRY)
    add_gpu_arguments(gpu)

    stats = sub.add_parser("peer-stats", help="print a GPU peer's per-channel counters (JSON)")
    stats.add_argument("--peer", default=f"127.0.0.1:{DEFAULT_PEER_PORT}", help="HOST:PORT")

    demo = sub.add_parser("demo", help="start a peer and a daemon, stream one completion, stop")
    demo.add_argument("--transport", choices=("verbs", "shm"), default="verbs")
    demo.add_argument("--rdma-ip", default=None)
    demo.add_argument("--prompt", default="Hello")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--port", type=int, default=8000)

    softroce = sub.add_parser("softroce", help="run a command with a soft-RoCE device "
                                               "(natively, or in a micro-VM)")
    softroce.add_argument("--mode", choices=("auto", "native", "vm"), default="auto")
    softroce.add_argument("--timeout", type=int, default=3600, help="seconds, for the VM")
    softroce.add_argument("--memory", default="2G", help="VM memory")
    softroce.add_argument("--rwdir", action="append", default=[],
                          help="a directory the VM may write (results, logs); repeatable")
    softroce.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return parser


def _peer_settings(parser: argparse.ArgumentParser, geometry: Geometry) -> None:
    """What the reference peer and the CUDA peer share: address, region, token source."""
    _common(parser)
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="control-plane listen address")
    add("--port", type=int, default=DEFAULT_PEER_PORT, help="control-plane port")
    add("--shm-path", type=Path, default=Path("/dev/shm/dpu-frontend-peer"))
    add("--channels", type=int, default=geometry.channels, help="ring pairs (one per daemon worker)")
    add("--req-slots", type=int, default=geometry.req_slots)
    add("--arena-bytes", type=int, default=geometry.arena_bytes)
    add("--resp-slots", type=int, default=geometry.resp_slots,
        help=f"response slots per channel, >= 2 x --max-sequences (default {geometry.resp_slots})")
    add("--resp-slot-size", type=int, default=geometry.resp_slot_size)
    add("--max-sequences", type=int, default=geometry.max_sequences,
        help=f"sequences a channel runs at once (default {geometry.max_sequences})")
    add("--max-prompt-tokens", type=int, default=geometry.max_prompt_tokens,
        help="longest prompt taken, 0: the whole arena (default %(default)s)")
    add("--mode", choices=("replay", "echo"), default="replay")
    add("--tokens-per-step", type=int, default=0,
        help="tokens per sequence per engine step, 0: a full record (default 0)")


def _rdma(args: argparse.Namespace) -> RdmaConfig:
    return RdmaConfig(device=args.rdma_device, ip=args.rdma_ip)


def serve_config(args: argparse.Namespace) -> tuple[ServeConfig, dict[str, Any]]:
    """The config (file < environment < flags) and the logging settings."""
    flags = {key: getattr(args, key) for key in PARSERS if hasattr(args, key)}
    return build(flags, config_path=args.config, env=os.environ)


def peer_config(args: argparse.Namespace) -> PeerConfig:
    return PeerConfig(
        transport=args.transport, rdma=_rdma(args), host=args.host, port=args.port,
        shm_path=args.shm_path,
        geometry=Geometry(channels=args.channels, req_slots=args.req_slots,
                          arena_bytes=args.arena_bytes, resp_slots=args.resp_slots,
                          resp_slot_size=args.resp_slot_size, max_sequences=args.max_sequences,
                          max_prompt_tokens=args.max_prompt_tokens),
        mode=args.mode, tokens_per_s=getattr(args, "tokens_per_s", 0.0),
        tokens_per_step=args.tokens_per_step, tick_s=getattr(args, "tick", 0.001),
        tokenizer=args.tokenizer,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "softroce":
            return run_cli(args.mode, args.argv, timeout=args.timeout, memory=args.memory,
                           rwdirs=args.rwdir)
        if args.command == "peer-stats":
            channels = asyncio.run(peer_stats(PeerAddress.parse(args.peer)))
            print(json.dumps(channels, indent=2))
            return 0
        if args.command == "demo":
            return run_demo(transport=args.transport, rdma_ip=args.rdma_ip, prompt=args.prompt,
                            max_tokens=args.max_tokens, port=args.port)
        if args.command in ("serve", "check"):
            config, log_settings = serve_config(args)
            configure(log_settings.get("log_level", "INFO"), log_settings.get("log_format", "text"))
            if args.command == "check":
                return uvloop.run(run_check(config))
            if config.workers > 1 and config.worker_index is None:
                return uvloop.run(supervise(config, list(argv if argv is not None
                                                         else sys.argv[1:])))
            return uvloop.run(serve(config))
        configure(args.log_level)
        if args.command == "gpu-peer":
            return uvloop.run(run_gpu_peer(gpu_peer_config(args, peer_config(args))))
        return uvloop.run(run_peer(peer_config(args)))
    except ValueError as exc:
        parser.error(str(exc))
    except DpuFrontendError as exc:
        print(f"dpu-frontend: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
