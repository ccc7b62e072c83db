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

import uvloop

from dpu_frontend import __version__
from dpu_frontend.config import (
    DEFAULT_PEER,
    DEFAULT_TRANSPORT,
    REFERENCE_GEOMETRY,
    TRANSPORTS,
    LoggingConfig,
    PeerAddress,
    PeerConfig,
    ServeConfig,
)
from dpu_frontend.errors import DpuFrontendError
from dpu_frontend.flags import Flags, help_text
from dpu_frontend.gpu.options import GPU_GEOMETRY, GpuPeerConfig
from dpu_frontend.logs import configure
from dpu_frontend.model.options import ModelPeerOptions
from dpu_frontend.settings import DEFAULT_PATH as DEFAULT_CONFIG
from dpu_frontend.settings import SETTINGS, build
from dpu_frontend.softroce.harness import MODES as SOFTROCE_MODES

log = logging.getLogger("dpu_frontend")

# The peers' flags, derived from the configs each command builds (flags.Flags): a
# field's flag defaults to the value given here, and a field that is no flag of the
# command keeps it.
#: The reference peer's own pace, a rate or GPU-like steps: the model peer's engine
#: and the CUDA kernel (--step-us) set their own.
REFERENCE_PACE = frozenset({"tokens_per_s", "step_s", "batch"})
PEER = Flags(PeerConfig(geometry=REFERENCE_GEOMETRY))
#: The model peer's rings take structured output as the reference peer's do (its
#: sampler walks the automata on the GPU, with either scheduler).
MODEL_PEER = Flags(PeerConfig(geometry=REFERENCE_GEOMETRY), omit=REFERENCE_PACE)
MODEL_OPTIONS = Flags(ModelPeerOptions())
#: The peers log text lines, at this level.
PEER_LOGGING = Flags(LoggingConfig(), omit=frozenset({"format"}), prefix="log_")


def gpu_peer_flags() -> Flags[GpuPeerConfig]:
    """``gpu-peer``'s: GPU_GEOMETRY's rings; neither the host loop's pace and clock (the
    kernel paces itself: --step-us, --heartbeat-us) nor --logprobs (its replay has no
    distribution to give them of). A function: the build directory's default follows the
    environment when it is called, as ``GpuPeerConfig()``'s does."""
    host_loop = {f"peer.{name}" for name in (*REFERENCE_PACE, "tick_s", "heartbeat_s")}
    return Flags(GpuPeerConfig(peer=PeerConfig(geometry=GPU_GEOMETRY)),
                 omit=frozenset({*host_loop, "peer.geometry.logprobs"}))


def _serve_settings(parser: argparse.ArgumentParser) -> None:
    """A flag per setting, derived from its field (``settings.SETTINGS``).

    Every flag defaults to None: only flags given on the command line override
    the file and the environment. Their values stay strings, parsed in
    ``build`` as the environment's are; the help shows the dataclass default.
    """
    for setting in SETTINGS.values():
        text = help_text(setting.doc, setting.default, f"[{setting.key}]")
        parser.add_argument(setting.flag, dest=setting.key, default=None,
                            action="append" if setting.repeated else "store",
                            choices=setting.doc.choices or None,
                            help=argparse.SUPPRESS if setting.doc.hidden else text)


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
    PEER.add_to(peer)
    gpu = sub.add_parser("gpu-peer", help="run the CUDA peer: the ring served by a persistent "
                                          "GPU kernel (needs a CUDA GPU and nvcc)")
    gpu_peer_flags().add_to(gpu)
    model = sub.add_parser("model-peer", help="run the model engine behind the ring, "
                                              "host-driven (needs a CUDA GPU, torch, Triton)")
    MODEL_PEER.add_to(model)
    MODEL_OPTIONS.add_to(model)
    for command in (peer, gpu, model):
        PEER_LOGGING.add_to(command)

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
    softroce.add_argument("--mode", choices=SOFTROCE_MODES, default=SOFTROCE_MODES[0])
    softroce.add_argument("--timeout", type=int, default=3600, help="seconds, for the VM")
    softroce.add_argument("--memory", default="2G", help="VM memory")
    softroce.add_argument("--rwdir", action="append", default=[],
                          help="a directory the VM may write (results, logs); repeatable")
    softroce.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return parser


def serve_config(args: argparse.Namespace) -> tuple[ServeConfig, LoggingConfig]:
    """The config (file < environment < flags) and the logging settings."""
    flags = {key: getattr(args, key) for key in SETTINGS}
    return build(flags, config_path=args.config, env=os.environ)


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
    logging_config = PEER_LOGGING.build(args)
    configure(logging_config.level, logging_config.format)
    if args.command == "model-peer":
        peer, options = MODEL_PEER.build(args), MODEL_OPTIONS.build(args)
        from dpu_frontend.model.peer import run_model_peer  # torch: only for this command
        return lambda: uvloop.run(run_model_peer(peer, options))
    if args.command == "gpu-peer":
        gpu = gpu_peer_flags().build(args)
        from dpu_frontend.gpu.launcher import run_gpu_peer
        return lambda: uvloop.run(run_gpu_peer(gpu))
    peer = PEER.build(args)
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
