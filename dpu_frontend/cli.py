"""``dpu-frontend``: serve, check, peer, gpu-peer, model-peer, peer-stats, demo, softroce.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import uvloop

from dpu_frontend import __version__
from dpu_frontend.config import (
    DEFAULT_PEER,
    DEFAULT_TRANSPORT,
    PEER_MODES,
    TRANSPORTS,
    LoggingConfig,
    PeerAddress,
    PeerConfig,
    RdmaConfig,
    ServeConfig,
)
from dpu_frontend.errors import DpuFrontendError
from dpu_frontend.gpu.launcher import GPU_GEOMETRY, add_gpu_arguments, gpu_peer_config
from dpu_frontend.logs import configure
from dpu_frontend.model.options import add_model_arguments, model_peer_options
from dpu_frontend.ring import Geometry
from dpu_frontend.settings import DEFAULT_PATH as DEFAULT_CONFIG
from dpu_frontend.settings import SETTINGS, Setting, build

log = logging.getLogger("dpu_frontend")


def _shown(setting: Setting, default: Any) -> str:
    """``(default X)`` for a flag's help: the value, or what None means for this setting."""
    if default is None:
        return f"(default: {setting.doc.none})"
    if isinstance(default, tuple):
        return f"(default {', '.join(map(str, default))})"
    return f"(default {default})"


def _help(text: str) -> str:
    return text.replace("%", "%%")  # argparse %-formats help texts


def _serve_settings(parser: argparse.ArgumentParser) -> None:
    """A flag per setting, derived from its field (``settings.SETTINGS``).

    Every flag defaults to None: only flags given on the command line override
    the file and the environment. Their values stay strings, parsed in
    ``build`` as the environment's are; the help shows the dataclass default.
    """
    for setting in SETTINGS.values():
        text = f"{setting.doc.help} {_shown(setting, setting.default)} [{setting.key}]"
        parser.add_argument(setting.flag, dest=setting.key, default=None,
                            action="append" if setting.repeated else "store",
                            choices=setting.doc.choices or None,
                            help=argparse.SUPPRESS if setting.doc.hidden else _help(text))


def _common(parser: argparse.ArgumentParser, peer: PeerConfig) -> None:
    """The flags a peer shares with ``serve``: the same help, the peer's defaults."""
    shared = {"transport": peer.transport, "rdma_device": peer.rdma.device,
              "rdma_ip": peer.rdma.ip, "tokenizer": peer.tokenizer,
              "log_level": LoggingConfig().level}
    for key, default in shared.items():
        setting = SETTINGS[key]
        parser.add_argument(setting.flag, dest=key, type=setting.parse, default=default,
                            choices=setting.doc.choices or None,
                            help=_help(f"{setting.doc.help} {_shown(setting, default)}"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dpu-frontend", description=__doc__)
    parser.add_argument("--version", action="version", version=f"dpu-frontend {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    sources = ("Settings come from the [serve] table of the config file, then "
               "DPU_FRONTEND_<SETTING> environment variables (e.g. DPU_FRONTEND_PORT), then these "
               "flags. Every setting has a flag, which names it in brackets: the flag is the key "
               "with dashes, less a unit suffix _s (poll_interval_s: --poll-interval); peers is "
               "--peer, given once per peer. The defaults shown are the built-in ones.")
    serve = sub.add_parser(
        "serve", help="run the daemon (OpenAI-compatible HTTP in front of GPU peers)",
        description=sources)
    check = sub.add_parser("check", help="diagnose what a deployment needs (RDMA, memlock, "
                                         "tokenizer, GPU peers); non-zero exit on a problem",
                           description=sources)
    for daemon in (serve, check):
        daemon.add_argument("--config", type=Path, default=None,
                            help=f"TOML file (default {DEFAULT_CONFIG} if it exists)")
        _serve_settings(daemon)

    peer = sub.add_parser("peer", help="run the reference GPU peer")
    _peer_settings(peer, Geometry())
    defaults = PeerConfig()
    peer.add_argument("--tokens-per-s", type=float, default=defaults.tokens_per_s,
                      help="per-sequence generation rate, 0: as fast as the ring takes "
                           "(default %(default)s)")
    peer.add_argument("--step-ms", type=float, default=defaults.step_s * 1e3, metavar="MS",
                      help="GPU-like decode steps: every MS milliseconds each running sequence "
                           "gets one token (a burst of one-token records); replaces "
                           "--tokens-per-s; 0: off (default %(default)s)")
    peer.add_argument("--batch", type=int, default=defaults.batch,
                      help="with --step-ms: sequences a step decodes at most, over every "
                           "channel; the rest wait for a slot (default %(default)s: no limit)")
    _pace(peer, "engine step period")

    gpu = sub.add_parser("gpu-peer", help="run the CUDA peer: the ring served by a persistent "
                                          "GPU kernel (needs a CUDA GPU and nvcc)")
    _peer_settings(gpu, GPU_GEOMETRY)
    add_gpu_arguments(gpu)

    model = sub.add_parser("model-peer", help="run the model engine behind the ring, "
                                              "host-driven (needs a CUDA GPU, torch, Triton)")
    _peer_settings(model, Geometry())
    _pace(model, "idle poll period")
    add_model_arguments(model)

    stats = sub.add_parser("peer-stats", help="print a GPU peer's per-channel counters (JSON)")
    stats.add_argument("--peer", default=str(DEFAULT_PEER), help="HOST:PORT (default %(default)s)")

    demo = sub.add_parser("demo", help="start a peer and a daemon, stream one completion, stop")
    demo.add_argument("--transport", choices=TRANSPORTS, default=DEFAULT_TRANSPORT)
    demo.add_argument("--rdma-ip", default=None)
    demo.add_argument("--prompt", default="Hello")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.add_argument("--port", type=int, default=SETTINGS["port"].default,
                      help="the daemon's HTTP port (default %(default)s)")

    softroce = sub.add_parser("softroce", help="run a command with a soft-RoCE device "
                                               "(natively, or in a micro-VM)")
    softroce.add_argument("--mode", choices=("auto", "native", "vm"), default="auto")
    softroce.add_argument("--timeout", type=int, default=3600, help="seconds, for the VM")
    softroce.add_argument("--memory", default="2G", help="VM memory")
    softroce.add_argument("--rwdir", action="append", default=[],
                          help="a directory the VM may write (results, logs); repeatable")
    softroce.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return parser


def _pace(parser: argparse.ArgumentParser, tick: str) -> None:
    """The host-driven peers' clocks: the loop's tick and the heartbeat's period."""
    defaults = PeerConfig()
    parser.add_argument("--tick", dest="tick_s", metavar="SECONDS", type=float,
                        default=defaults.tick_s, help=f"{tick}, seconds (default %(default)s)")
    parser.add_argument("--heartbeat", dest="heartbeat_s", metavar="SECONDS", type=float,
                        default=defaults.heartbeat_s,
                        help="heartbeat period, seconds; keep the daemons' peer_timeout at "
                             "least 4 times it (default %(default)s)")


def _peer_settings(parser: argparse.ArgumentParser, geometry: Geometry) -> None:
    """What the reference peer and the CUDA peer share: address, region, token source.

    The defaults are ``PeerConfig``'s, and ``geometry``'s for the rings.
    """
    defaults = PeerConfig()
    _common(parser, defaults)
    add = parser.add_argument
    add("--host", default=defaults.host, help="control-plane listen address (default %(default)s)")
    add("--port", type=int, default=defaults.port, help="control-plane port (default %(default)s)")
    add("--shm-path", type=Path, default=defaults.shm_path,
        help="the ring region's file, with --transport shm (default %(default)s)")
    add("--channels", type=int, default=geometry.channels, help="ring pairs (one per daemon worker)")
    add("--req-slots", type=int, default=geometry.req_slots)
    add("--arena-bytes", type=int, default=geometry.arena_bytes)
    add("--resp-slots", type=int, default=geometry.resp_slots,
        help=f"response slots per channel, >= 2 x --max-sequences (default {geometry.resp_slots})")
    add("--resp-slot-size", type=int, default=geometry.resp_slot_size,
        help=f"bytes per response record (default {geometry.resp_slot_size})")
    if geometry.logprobs:  # a peer whose source has a distribution (not the CUDA replay)
        add("--logprobs", action=argparse.BooleanOptionalAction, default=True,
            help="offer log probabilities (needs --resp-slot-size >= 96; default on)")
    add("--max-sequences", type=int, default=geometry.max_sequences,
        help=f"sequences a channel runs at once (default {geometry.max_sequences})")
    add("--max-prompt-tokens", type=int, default=geometry.max_prompt_tokens,
        help="longest prompt taken, 0: the whole arena (default %(default)s)")
    add("--mode", choices=PEER_MODES, default=defaults.mode,
        help="replay a corpus, or echo the prompt (default %(default)s)")
    add("--tokens-per-step", type=int, default=defaults.tokens_per_step,
        help="tokens per sequence per engine step, 0: a full record (default %(default)s)")
    add("--secret-file", type=Path, default=defaults.secret_file,
        help="the secret shared with the daemons (their peer_secret_file): a hello that "
             "does not prove it gets no channel, no rkey and no QP; mode 600 "
             "(default: none, any client on the control port is served)")


def _rdma(args: argparse.Namespace) -> RdmaConfig:
    return RdmaConfig(device=args.rdma_device, ip=args.rdma_ip)


def serve_config(args: argparse.Namespace) -> tuple[ServeConfig, LoggingConfig]:
    """The config (file < environment < flags) and the logging settings."""
    flags = {key: getattr(args, key) for key in SETTINGS}
    return build(flags, config_path=args.config, env=os.environ)


def peer_config(args: argparse.Namespace) -> PeerConfig:
    # --tokens-per-s and --tick pace the reference peer only; the CUDA peer
    # (--step-us) has neither and leaves PeerConfig's defaults, unread.
    defaults = PeerConfig()
    return PeerConfig(
        transport=args.transport, rdma=_rdma(args), host=args.host, port=args.port,
        shm_path=args.shm_path,
        geometry=Geometry(channels=args.channels, req_slots=args.req_slots,
                          arena_bytes=args.arena_bytes, resp_slots=args.resp_slots,
                          resp_slot_size=args.resp_slot_size, max_sequences=args.max_sequences,
                          max_prompt_tokens=args.max_prompt_tokens,
                          logprobs=getattr(args, "logprobs", False)),
        mode=args.mode, tokens_per_s=getattr(args, "tokens_per_s", defaults.tokens_per_s),
        tokens_per_step=args.tokens_per_step, tick_s=getattr(args, "tick_s", defaults.tick_s),
        step_s=getattr(args, "step_ms", 0.0) / 1e3, batch=getattr(args, "batch", defaults.batch),
        heartbeat_s=getattr(args, "heartbeat_s", defaults.heartbeat_s),
        tokenizer=args.tokenizer, secret_file=args.secret_file,
    )


def _runner(args: argparse.Namespace, argv: Sequence[str] | None) -> Callable[[], int]:
    """What ``args`` asks for, ready to run. Every config is built, and so validated,
    here: a ``ValueError`` from this function is a usage error, one raised while the
    command runs is a bug.

    Each command's module is imported when that command runs: a peer or a check
    process then starts without the daemon's HTTP stack, which the micro-VM's
    software CPU takes seconds to import (tests/rdma start one per test).
    """
    if args.command == "softroce":
        from dpu_frontend.softroce.harness import run_cli

        return lambda: run_cli(args.mode, args.argv, timeout=args.timeout, memory=args.memory,
                               rwdirs=args.rwdir)
    if args.command == "peer-stats":
        address = PeerAddress.parse(args.peer)
        return lambda: _print_stats(address)
    if args.command == "demo":
        from dpu_frontend.softroce.demo import run_demo
        return lambda: run_demo(transport=args.transport, rdma_ip=args.rdma_ip,
                                prompt=args.prompt, max_tokens=args.max_tokens, port=args.port)
    if args.command in ("serve", "check"):
        config, logging_config = serve_config(args)
        configure(logging_config.level, logging_config.format)
        if args.command == "check":
            from dpu_frontend.check import run_check
            return lambda: uvloop.run(run_check(config))
        if config.workers > 1 and config.worker_index is None:
            from dpu_frontend.workers import supervise
            command_line = list(argv if argv is not None else sys.argv[1:])
            return lambda: uvloop.run(supervise(config, command_line))
        from dpu_frontend.daemon import serve
        return lambda: uvloop.run(serve(config))
    logging_config = LoggingConfig(level=args.log_level)
    configure(logging_config.level, logging_config.format)
    peer = peer_config(args)
    if args.command == "model-peer":
        options = model_peer_options(args)
        from dpu_frontend.model.peer import run_model_peer  # torch: only for this command
        return lambda: uvloop.run(run_model_peer(peer, options))
    if args.command == "gpu-peer":
        from dpu_frontend.gpu.launcher import run_gpu_peer
        gpu = gpu_peer_config(args, peer)
        return lambda: uvloop.run(run_gpu_peer(gpu))
    from dpu_frontend.peer.server import run_peer
    return lambda: uvloop.run(run_peer(peer))


def _print_stats(address: PeerAddress) -> int:
    from dpu_frontend.control.stats import peer_report
    print(json.dumps(asyncio.run(peer_report(address)), indent=2))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run = _runner(args, argv)
    except ValueError as exc:  # a bad flag, file or environment value: exit 2
        parser.error(str(exc))
    try:
        return run()
    except DpuFrontendError as exc:  # an expected failure (start-up, a peer): its message
        print(f"dpu-frontend: {exc}", file=sys.stderr)
        return 1
    except Exception:  # a bug, whatever its type: the traceback, and a crash's status
        log.exception("dpu-frontend %s crashed", args.command)
        return 1


if __name__ == "__main__":
    sys.exit(main())
