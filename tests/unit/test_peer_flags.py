"""The peers' flags (``peer``, ``gpu-peer``, ``model-peer``), pinned as they were before
issue 23 derived them from the option dataclasses: tests, docs, systemd units and
benchmarks invoke them, so every flag keeps its name, default, choices and meaning."""

from __future__ import annotations

import argparse
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import pytest

from dpu_frontend import cli
from dpu_frontend.cli import (
    MODEL_OPTIONS,
    MODEL_PEER,
    PEER,
    PEER_LOGGING,
    build_parser,
    gpu_peer_flags,
)
from dpu_frontend.config import REFERENCE_GEOMETRY, LoggingConfig, PeerConfig, RdmaConfig
from dpu_frontend.flags import doc, flag_name
from dpu_frontend.gpu.options import GPU_GEOMETRY, GpuPeerConfig
from dpu_frontend.gpu.runtime import default_build_dir
from dpu_frontend.model.options import EngineOptions, ModelPeerOptions, RunnerOptions
from dpu_frontend.ring import Geometry

SWITCH = "switch"  # a flag without a value
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: What every peer takes: (default in the flag's own unit, choices or SWITCH or None).
SHARED: dict[str, tuple[Any, Any]] = {
    "--transport": ("verbs", ("verbs", "shm")), "--rdma-device": (None, None),
    "--rdma-ip": (None, None), "--tokenizer": (None, None), "--log-level": ("INFO", LOG_LEVELS),
    "--host": ("127.0.0.1", None), "--port": (18515, None),
    "--shm-path": (Path("/dev/shm/dpu-frontend-peer"), None), "--channels": (1, None),
    "--req-slots": (256, None), "--mode": ("replay", ("replay", "echo")),
    "--tokens-per-step": (0, None), "--secret-file": (None, None),
}
#: Geometry() (the reference and model peers' REFERENCE_GEOMETRY differs below) and
#: GPU_GEOMETRY (CUDA peer).
GEOMETRY = {"--arena-bytes": (4 << 20, None), "--resp-slots": (1024, None),
            "--resp-slot-size": (96, None), "--max-sequences": (256, None),
            "--max-prompt-tokens": (0, None), "--logprobs": (True, SWITCH),
            "--no-logprobs": (True, SWITCH)}
GPU_GEOMETRY_FLAGS = {"--arena-bytes": (8 << 20, None), "--resp-slots": (2048, None),
                      "--resp-slot-size": (64, None), "--max-sequences": (1024, None),
                      "--max-prompt-tokens": (32768, None),
                      "--max-automaton-bytes": (4 << 20, None)}
CLOCK = {"--tick": (0.001, None), "--heartbeat": (0.05, None)}
FLAGS: dict[str, dict[str, tuple[Any, Any]]] = {
    "peer": SHARED | GEOMETRY | CLOCK | {
        "--arena-bytes": (36 << 20, None), "--max-automaton-bytes": (32 << 20, None),
        "--tokens-per-s": (50.0, None), "--step-ms": (0.0, None), "--batch": (0, None)},
    "gpu-peer": SHARED | GPU_GEOMETRY_FLAGS | {
        "--device": (0, None), "--engine-blocks": (0, None), "--step-us": (0.0, None),
        "--prefill-us-per-token": (0.0, None), "--heartbeat-us": (100.0, None),
        "--library": (None, None), "--build-dir": (default_build_dir(), None),
        "--cuda-arch": ("sm_90", None), "--nvcc": (None, None),
        "--automaton-pool-bytes": (64 << 20, None)},
    "model-peer": SHARED | GEOMETRY | CLOCK | {
        "--arena-bytes": (36 << 20, None), "--max-automaton-bytes": (32 << 20, None),
        "--automaton-pool-bytes": (512 << 20, None),
        "--weights": (None, None), "--model-config": (None, None),
        "--dtype": ("bfloat16", ("bfloat16", "float16", "float32")), "--device": (0, None),
        "--quantization": ("none", ("none", "fp8")), "--kv-cache-dtype": ("auto", ("auto", "fp8")),
        "--weight-seed": (0, None), "--max-seqs": (256, None), "--max-model-len": (8192, None),
        "--kv-blocks": (0, None), "--block-size": (32, (16, 32, 64)),
        "--memory-fraction": (0.85, None), "--max-batched-tokens": (2048, None),
        "--no-cuda-graphs": (True, SWITCH), "--overlap": (True, SWITCH),
        "--no-overlap": (True, SWITCH), "--records": ("gpu", ("gpu", "host")),
        "--records-library": (None, None), "--scheduler": ("host", ("host", "gpu")),
        "--scheduler-library": (None, None)},
}


@pytest.fixture(autouse=True)
def _root_logger(restored_root_logger: None) -> None:
    """``main`` configures the root logger: conftest puts it back after each test."""


def subcommand(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    chosen: argparse.ArgumentParser = sub.choices[command]
    return chosen


def configs(*argv: str) -> tuple[object, ...]:
    """What the CLI builds from ``argv``: the command's configs, and the logging settings."""
    args = build_parser().parse_args(list(argv))
    logging_config = PEER_LOGGING.build(args)
    if args.command == "gpu-peer":
        return gpu_peer_flags().build(args), logging_config
    if args.command == "model-peer":
        return MODEL_PEER.build(args), MODEL_OPTIONS.build(args), logging_config
    return PEER.build(args), logging_config


#: The model peer's rings without a flag: the reference peer's, structured output included.
MODEL_DEFAULT = PeerConfig(geometry=REFERENCE_GEOMETRY)
DEFAULTS: dict[str, tuple[object, ...]] = {
    "peer": (PeerConfig(geometry=REFERENCE_GEOMETRY), LoggingConfig()),
    "gpu-peer": (GpuPeerConfig(peer=PeerConfig(geometry=GPU_GEOMETRY)), LoggingConfig()),
    "model-peer": (PeerConfig(geometry=REFERENCE_GEOMETRY),
                   ModelPeerOptions(None, RunnerOptions(), EngineOptions()), LoggingConfig()),
}


@pytest.mark.parametrize("command", FLAGS)
def test_each_peer_command_has_exactly_its_flags(command: str) -> None:
    actions = {s: a for a in subcommand(command)._actions for s in a.option_strings}
    assert set(actions) - {"-h", "--help"} == set(FLAGS[command])
    for flag, (_, choices) in FLAGS[command].items():
        action = actions[flag]
        if choices == SWITCH:
            assert action.nargs == 0, flag
        else:
            assert action.nargs is None and action.choices == choices, flag


@pytest.mark.parametrize("command", FLAGS)
def test_no_flag_builds_the_defaults(command: str) -> None:
    assert configs(command) == DEFAULTS[command]


@pytest.mark.parametrize(("command", "flag"), [(c, f) for c, flags in FLAGS.items()
                                               for f, (d, _) in flags.items() if d is not None])
def test_each_flag_given_its_default_changes_nothing(command: str, flag: str) -> None:
    default, choices = FLAGS[command][flag]
    if choices == SWITCH:  # the switch that keeps the default
        if flag.startswith("--no-") and default:
            return
        assert configs(command, flag) == DEFAULTS[command]
    else:
        assert configs(command, flag, str(default)) == DEFAULTS[command]


#: Argument lists and the configs the hand-written functions built from them.
CASES: list[tuple[list[str], tuple[object, ...]]] = [
    (["peer", "--transport", "shm", "--rdma-device", "rxe0", "--rdma-ip", "10.0.0.1",
      "--tokenizer", "/tok", "--log-level", "DEBUG", "--host", "0.0.0.0", "--port", "0",
      "--shm-path", "/dev/shm/x", "--channels", "2", "--req-slots", "8", "--arena-bytes", "1024",
      "--resp-slots", "64", "--resp-slot-size", "128", "--no-logprobs", "--max-sequences", "4",
      "--max-prompt-tokens", "100", "--max-automaton-bytes", "256", "--mode", "echo",
      "--tokens-per-step", "1",
      "--secret-file", "/s", "--tokens-per-s", "0", "--step-ms", "5", "--batch", "2",
      "--tick", "0.005", "--heartbeat", "0.02"],
     (PeerConfig(transport="shm", rdma=RdmaConfig("rxe0", "10.0.0.1"), host="0.0.0.0", port=0,
                 shm_path=Path("/dev/shm/x"),
                 geometry=Geometry(channels=2, req_slots=8, arena_bytes=1024, resp_slots=64,
                                   resp_slot_size=128, max_sequences=4, max_prompt_tokens=100,
                                   logprobs=False, max_automaton_bytes=256),
                 mode="echo", tokens_per_s=0.0, tokens_per_step=1, tick_s=0.005, step_s=0.005,
                 batch=2, heartbeat_s=0.02, tokenizer=Path("/tok"), secret_file=Path("/s")),
      LoggingConfig(level="DEBUG"))),
    # Empty values: the shared flags read "" as the daemon does (not set); an empty secret
    # file is not "no secret": the peer refuses to start rather than serve unauthenticated.
    (["peer", "--rdma-device", "", "--rdma-ip", "", "--tokenizer", "", "--secret-file", "",
      "--step-ms", "2.5", "--logprobs"],
     (PeerConfig(secret_file=Path(""), step_s=0.0025, geometry=REFERENCE_GEOMETRY),
      LoggingConfig())),
    (["gpu-peer", "--transport", "shm", "--channels", "2", "--max-sequences", "8",
      "--resp-slots", "16", "--tokens-per-step", "1", "--mode", "echo", "--device", "1",
      "--engine-blocks", "4", "--step-us", "2000", "--prefill-us-per-token", "100",
      "--heartbeat-us", "50", "--library", "/lib.so", "--build-dir", "/b", "--cuda-arch", "sm_80",
      "--nvcc", "/usr/bin/nvcc", "--log-level", "WARNING", "--max-automaton-bytes", "65536",
      "--automaton-pool-bytes", "1048576"],
     (GpuPeerConfig(peer=PeerConfig(transport="shm", mode="echo", tokens_per_step=1,
                                    geometry=replace(GPU_GEOMETRY, channels=2, max_sequences=8,
                                                     resp_slots=16, max_automaton_bytes=65536)),
                    device=1, engine_blocks=4, step_us=2000.0, prefill_us_per_token=100.0,
                    heartbeat_us=50.0, library=Path("/lib.so"), build_dir=Path("/b"),
                    cuda_arch="sm_80", nvcc="/usr/bin/nvcc", automaton_pool_bytes=1 << 20),
      LoggingConfig(level="WARNING"))),
    (["model-peer", "--transport", "shm", "--tick", "0.005", "--heartbeat", "0.02",
      "--no-logprobs", "--resp-slot-size", "64", "--weights", "/w", "--model-config", "/c.json",
      "--dtype", "float32", "--device", "1", "--weight-seed", "7", "--max-seqs", "64",
      "--max-model-len", "4096", "--kv-blocks", "100", "--block-size", "16",
      "--memory-fraction", "0.5", "--max-batched-tokens", "512", "--no-cuda-graphs",
      "--no-overlap", "--records", "host", "--records-library", "/r.so",
      "--scheduler-library", "/s.so", "--max-automaton-bytes", "1024",
      "--automaton-pool-bytes", "65536"],
     (PeerConfig(transport="shm", tick_s=0.005, heartbeat_s=0.02,
                 geometry=replace(REFERENCE_GEOMETRY, resp_slot_size=64, logprobs=False,
                                  max_automaton_bytes=1024)),
      ModelPeerOptions(Path("/c.json"),
                       RunnerOptions(dtype="float32", device=1, weights=Path("/w"), weight_seed=7,
                                     block_size=16, num_blocks=100, memory_fraction=0.5,
                                     max_seqs=64, max_model_len=4096, cuda_graphs=False,
                                     automaton_pool_bytes=65536),
                       EngineOptions(max_batched_tokens=512, overlap=False),
                       records="host", records_library=Path("/r.so"),
                       scheduler_library=Path("/s.so")),
      LoggingConfig())),
    (["model-peer", "--scheduler", "gpu", "--overlap", "--max-seqs", "1024"],
     (MODEL_DEFAULT, ModelPeerOptions(None, RunnerOptions(max_seqs=1024), EngineOptions(),
                                      scheduler="gpu"), LoggingConfig())),
    (["model-peer", "--quantization", "fp8", "--kv-cache-dtype", "fp8"],
     (MODEL_DEFAULT, ModelPeerOptions(None, RunnerOptions(quantization="fp8", kv_cache_dtype="fp8"),
                                      EngineOptions()), LoggingConfig())),
    (["model-peer", "--quantization", "fp8", "--dtype", "float16"],
     (MODEL_DEFAULT, ModelPeerOptions(None, RunnerOptions(dtype="float16", quantization="fp8"),
                                      EngineOptions()), LoggingConfig())),
]


@pytest.mark.parametrize(("argv", "expected"), CASES, ids=[c[0][0] for c in CASES])
def test_flags_build_the_configs_of_the_hand_written_functions(
        argv: list[str], expected: tuple[object, ...]) -> None:
    assert configs(*argv) == expected


@pytest.mark.parametrize(("argv", "message"), [
    (["peer", "--tick", "2"], "tick_s must be in (0, 1]"),
    (["peer", "--heartbeat", "0"], "heartbeat_s must be in [0.001, 1]"),
    (["peer", "--batch", "2"], "batch must be >= 0, and it needs GPU-like steps (step_s)"),
    (["peer", "--step-ms", "20000"], "step_s must be in [0, 10] seconds"),
    (["peer", "--transport", "carrier-pigeon"], "invalid choice: 'carrier-pigeon'"),
    (["peer", "--port", "70000"], "port must be a TCP port (0-65535), got 70000"),
    (["peer", "--port", "x"], "argument --port: invalid int value: 'x'"),
    (["peer", "--rdma-ip", "nope"], "rdma ip:"),
    (["peer", "--resp-slot-size", "64"], "resp_slot_size must be >= 96 to carry log probabilities"),
    (["model-peer", "--resp-slots", "8"], "resp_slots must be >= 2 * max_sequences (512)"),
    (["gpu-peer", "--heartbeat-us", "0"], "heartbeat_us must be in [1, 100000]"),
    (["gpu-peer", "--step-us", "-1"], "step_us and prefill_us_per_token must be >= 0"),
    # 4 MiB automata: 1,048,560 words of arrays and up to 349,520 states' distances, in
    # whole 128-byte lines.
    (["gpu-peer", "--automaton-pool-bytes", "4194304"],
     "automaton_pool_bytes (4194304) must hold the largest automaton, 5592448 bytes"),
    (["gpu-peer", "--automaton-pool-bytes", "-1"], "automaton_pool_bytes must be >= 0"),
    (["gpu-peer", "--logprobs"], "unrecognized arguments: --logprobs"),
    (["gpu-peer", "--tick", "0.01"], "unrecognized arguments: --tick"),
    (["model-peer", "--step-ms", "5"], "unrecognized arguments: --step-ms"),
    (["model-peer", "--memory-fraction", "0.01"], "memory_fraction 0.01 is outside [0.1, 0.98]"),
    (["model-peer", "--max-batched-tokens", "0"], "max_batched_tokens must be positive"),
    (["model-peer", "--block-size", "8"], "argument --block-size: invalid choice: 8"),
    (["model-peer", "--scheduler", "gpu", "--no-cuda-graphs"], "drop --no-cuda-graphs"),
    (["model-peer", "--scheduler", "gpu", "--records", "host"], "drop --records host"),
    (["model-peer", "--quantization", "int4"], "argument --quantization: invalid choice: 'int4'"),
    (["model-peer", "--kv-cache-dtype", "fp16"], "argument --kv-cache-dtype: invalid choice"),
    (["model-peer", "--dtype", "float32", "--quantization", "fp8"],
     "FP8 weights and KV cache run beside a 16-bit --dtype"),
    (["model-peer", "--dtype", "float32", "--kv-cache-dtype", "fp8"],
     "FP8 weights and KV cache run beside a 16-bit --dtype"),
    (["model-peer", "--dtype", "float16", "--kv-cache-dtype", "fp8"],
     "an FP8 KV cache runs beside --dtype bfloat16"),
])
def test_a_bad_value_exits_2_with_the_fields_message(
        capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage: dpu-frontend" in err and message in err


#: The option dataclasses, the prefix of their flags, and the commands that take them.
OPTION_CLASSES: list[tuple[type, str, tuple[str, ...]]] = [
    (PeerConfig, "", ("peer", "gpu-peer", "model-peer")),
    (RdmaConfig, "rdma_", ("peer", "gpu-peer", "model-peer")),
    (Geometry, "", ("peer", "gpu-peer", "model-peer")),
    (LoggingConfig, "log_", ("peer", "gpu-peer", "model-peer")),
    (GpuPeerConfig, "", ("gpu-peer",)),
    (RunnerOptions, "", ("model-peer",)), (EngineOptions, "", ("model-peer",)),
    (ModelPeerOptions, "", ("model-peer",)),
]
#: Fields with a Doc that a command has no flag for: the peers log text (the daemon's
#: --log-format); the reference peer's pace is its own, and the CUDA kernel has no host
#: loop and no distribution for log probabilities.
NOT_FLAGS = {
    "peer": {"log_format"},
    "gpu-peer": {"log_format", "tokens_per_s", "step_s", "batch", "tick_s", "heartbeat_s",
                 "logprobs"},
    "model-peer": {"log_format", "tokens_per_s", "step_s", "batch"},
}


@pytest.mark.parametrize(("cls", "prefix", "commands"), OPTION_CLASSES,
                         ids=[c[0].__name__ for c in OPTION_CLASSES])
def test_each_field_with_a_doc_is_a_flag(cls: type, prefix: str,
                                         commands: tuple[str, ...]) -> None:
    documented = {}
    for config_field in fields(cls):
        try:
            documented[prefix + config_field.name] = doc(config_field)
        except TypeError:  # not a setting: a nested config (its fields are), or set by the peer
            continue
    assert documented, cls
    for command in commands:
        taken = {s for a in subcommand(command)._actions for s in a.option_strings}
        for key, found in documented.items():
            assert (flag_name(key, found) in taken) == (key not in NOT_FLAGS[command]), \
                (command, key)


@pytest.mark.parametrize("command", FLAGS)
def test_each_flag_has_help_that_shows_its_default(command: str) -> None:
    """The per-geometry defaults included: gpu-peer's are GPU_GEOMETRY's."""
    for action in subcommand(command)._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flag = action.option_strings[0]
        default, _ = FLAGS[command][flag]
        assert action.help and len(action.help) > 12, flag
        if flag.startswith("--no-"):
            continue  # the flag is the change from the default
        if default is None:
            assert "(default: " in action.help, flag
        elif isinstance(default, bool):
            assert action.help.endswith(f"(default {'on' if default else 'off'})"), flag
        else:
            assert action.help.endswith(f"(default {default})"), flag
