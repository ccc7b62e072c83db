"""``dpu-frontend``: serve, peer, demo, softroce.

The CLI is the edge where configuration is built: flags become one frozen
config object, validated once; a bad value exits 2 with its message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

import uvloop

from dpu_frontend import __version__
from dpu_frontend.config import PeerAddress, PeerConfig, RdmaConfig, ServeConfig
from dpu_frontend.control.stats import peer_stats
from dpu_frontend.daemon import serve
from dpu_frontend.errors import DpuFrontendError
from dpu_frontend.peer.server import run_peer
from dpu_frontend.ring import Geometry
from dpu_frontend.softroce.demo import run_demo
from dpu_frontend.softroce.harness import run_cli

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpu-frontend", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dpu-frontend {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the daemon (OpenAI-compatible HTTP in front "
                                         "of a GPU peer)")
    _common(serve)
    serve.add_argument("--peer", action="append", default=[],
                       help="GPU peer control address HOST:PORT; repeat for several GPUs "
                            f"(default 127.0.0.1:{DEFAULT_PEER_PORT})")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP listen address")
    serve.add_argument("--port", type=int, default=8000, help="HTTP listen port (0: any)")
    serve.add_argument("--model-name", default="qwen3", help="the model name clients send")
    serve.add_argument("--chat-template", type=Path, default=None,
                       help="a .jinja chat template (default: the tokenizer config's)")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="context length (default: the tokenizer config's)")
    serve.add_argument("--channel", type=int, default=-1,
                       help="the peer's ring pair to claim (-1: any free one)")
    serve.add_argument("--poll-interval", type=float, default=0.0005,
                       help="seconds between response-ring polls while requests are in flight")
    serve.add_argument("--peer-timeout", type=float, default=1.0,
                       help="seconds without a heartbeat or an RDMA completion before a peer "
                            "is failed and its streams end with an error")
    serve.add_argument("--reconnect-max", type=float, default=5.0,
                       help="longest wait between reconnection attempts, seconds")
    serve.add_argument("--max-queued-requests", type=int, default=1024,
                       help="requests waiting for each peer's request ring before 429")
    serve.add_argument("--max-queued-prompt-tokens", type=int, default=1 << 20,
                       help="prompt tokens waiting for each peer's request ring before 429")
    serve.add_argument("--stream-buffer-records", type=int, default=4096,
                       help="response records buffered for one slow client before it is cut off")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="seconds open requests get to finish on SIGTERM")
    serve.add_argument("--tokenizer-threads", type=int, default=2,
                       help="threads tokenizing prompts (off the event loop)")

    peer = sub.add_parser("peer", help="run the reference GPU peer")
    _common(peer)
    peer.add_argument("--host", default="127.0.0.1", help="control-plane listen address")
    peer.add_argument("--port", type=int, default=DEFAULT_PEER_PORT, help="control-plane port")
    peer.add_argument("--shm-path", type=Path, default=Path("/dev/shm/dpu-frontend-peer"))
    peer.add_argument("--channels", type=int, default=1, help="ring pairs (one per daemon worker)")
    peer.add_argument("--req-slots", type=int, default=256)
    peer.add_argument("--arena-bytes", type=int, default=4 << 20)
    peer.add_argument("--resp-slots", type=int, default=1024)
    peer.add_argument("--resp-slot-size", type=int, default=64)
    peer.add_argument("--mode", choices=("replay", "echo"), default="replay")
    peer.add_argument("--tokens-per-s", type=float, default=50.0,
                      help="per-sequence generation rate (0: as fast as the ring takes)")
    peer.add_argument("--tick", type=float, default=0.001, help="engine step period, seconds")

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


def _rdma(args: argparse.Namespace) -> RdmaConfig:
    return RdmaConfig(device=args.rdma_device, ip=args.rdma_ip)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    peers = args.peer or [f"127.0.0.1:{DEFAULT_PEER_PORT}"]
    return ServeConfig(
        peers=tuple(PeerAddress.parse(p) for p in peers), transport=args.transport,
        rdma=_rdma(args),
        host=args.host, port=args.port, model_name=args.model_name, tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        max_model_len=args.max_model_len, channel=args.channel,
        poll_interval_s=args.poll_interval, peer_timeout_s=args.peer_timeout,
        reconnect_max_s=args.reconnect_max, max_queued_requests=args.max_queued_requests,
        max_queued_prompt_tokens=args.max_queued_prompt_tokens,
        stream_buffer_records=args.stream_buffer_records, drain_timeout_s=args.drain_timeout,
        tokenizer_threads=args.tokenizer_threads,
    )


def peer_config(args: argparse.Namespace) -> PeerConfig:
    return PeerConfig(
        transport=args.transport, rdma=_rdma(args), host=args.host, port=args.port,
        shm_path=args.shm_path,
        geometry=Geometry(channels=args.channels, req_slots=args.req_slots,
                          arena_bytes=args.arena_bytes, resp_slots=args.resp_slots,
                          resp_slot_size=args.resp_slot_size),
        mode=args.mode, tokens_per_s=args.tokens_per_s, tick_s=args.tick,
        tokenizer=args.tokenizer,
    )


def _logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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
        _logging(args.log_level)
        if args.command == "serve":
            return uvloop.run(serve(serve_config(args)))
        return uvloop.run(run_peer(peer_config(args)))
    except ValueError as exc:
        parser.error(str(exc))
    except DpuFrontendError as exc:
        print(f"dpu-frontend: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
