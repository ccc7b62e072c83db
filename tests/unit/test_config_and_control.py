"""Configuration validation and control-plane messages."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from dpu_frontend.cli import MODEL_PEER, PEER, build_parser
from dpu_frontend.config import PeerAddress, PeerConfig, ServeConfig
from dpu_frontend.control import messages
from dpu_frontend.errors import LayoutMismatch, PeerError
from dpu_frontend.ring import Geometry


def test_peer_address_parse() -> None:
    assert PeerAddress.parse("10.0.0.2:18515") == PeerAddress("10.0.0.2", 18515)
    assert PeerAddress.parse("[fe80::1]:7") == PeerAddress("fe80::1", 7)
    for bad in ("nohost", ":1", "h:x", "h:70000"):
        with pytest.raises(ValueError):
            PeerAddress.parse(bad)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"transport": "tcp"}, "transport"),
    ({"port": -1}, "port"),
    ({"model_name": ""}, "model_name"),
    ({"max_model_len": 0}, "max_model_len"),
    ({"poll_interval_s": 0}, "poll_interval_s"), ({"poll_interval_s": 0.0005}, "milliseconds"),
    ({"idle_poll_interval_s": 0}, "idle_poll_interval_s"),
    ({"workers": 2, "channel": 0}, "each worker needs a channel of its own"),
])
def test_serve_config_names_the_bad_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeConfig(peers=(PeerAddress("127.0.0.1", 1),), **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "dream"}, "mode"), ({"tokens_per_s": -1}, "tokens_per_s"), ({"tick_s": 0}, "tick_s"),
    ({"heartbeat_s": 0}, "heartbeat_s"), ({"heartbeat_s": 2}, "heartbeat_s"),
])
def test_peer_config_names_the_bad_field(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PeerConfig(**kwargs)


def test_geometry_validation() -> None:
    with pytest.raises(ValueError, match="resp_slot_size"):
        Geometry(resp_slot_size=30)
    with pytest.raises(ValueError, match="arena_bytes"):
        Geometry(arena_bytes=6)
    with pytest.raises(ValueError, match="2 \\* max_sequences"):
        Geometry(max_sequences=600, resp_slots=1024)


async def test_messages_roundtrip_over_a_real_socket() -> None:
    received: list[dict[str, object]] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await messages.receive(reader))
        await messages.send(writer, messages.Welcome(0, 7, 4096, {"path": "/dev/shm/x"}, epoch=3).to_dict())
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await messages.send(writer, messages.Hello("shm", 0).to_dict())
    welcome = messages.Welcome.from_dict(await messages.receive(reader))
    writer.close()
    await writer.wait_closed()
    server.close()
    await server.wait_closed()
    assert messages.Hello.from_dict(received[0]) == messages.Hello("shm", 0)
    assert welcome == messages.Welcome(0, 7, 4096, {"path": "/dev/shm/x"}, epoch=3)


def test_refuse_and_version_mismatch_are_clear() -> None:
    with pytest.raises(PeerError, match="refused the channel: busy"):
        messages.Welcome.from_dict(messages.refuse("busy"))
    bad = messages.Welcome(0, 7, 4096, {}, epoch=1).to_dict() | {"protocol": 3}
    with pytest.raises(LayoutMismatch, match="v3"):
        messages.Welcome.from_dict(bad)
    with pytest.raises(PeerError, match="epoch"):
        messages.Welcome.from_dict(messages.Welcome(0, 7, 4096, {}, epoch=0).to_dict())


def test_a_v1_peer_is_refused_with_a_clear_message() -> None:
    """A v1 peer refuses our v2 hello in its own words; the daemon must stop, not retry."""
    v1_refusal = messages.refuse("daemon speaks ring protocol v2, this peer v1")
    with pytest.raises(LayoutMismatch, match=r"peer speaks ring protocol v1.*upgrade the GPU peer"):
        messages.Welcome.from_dict(v1_refusal)
    with pytest.raises(LayoutMismatch, match="v1"):
        messages.Welcome.from_dict(messages.Welcome(0, 7, 4096, {}, epoch=1).to_dict()
                                   | {"protocol": 1})
    with pytest.raises(PeerError, match="unknown transport"):
        messages.Hello.from_dict({"op": "hello", "protocol": 1, "transport": "carrier-pigeon"})


async def test_truncated_frame_is_a_peer_error() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(b"\x00\x00\x00\x10abc")
    reader.feed_eof()
    with pytest.raises(PeerError, match="closed"):
        await messages.receive(reader)


def test_the_host_driven_peers_take_a_heartbeat_period() -> None:
    for command, flags in (("peer", PEER), ("model-peer", MODEL_PEER)):
        args = build_parser().parse_args([command, "--heartbeat", "0.02", "--tick", "0.005"])
        config = flags.build(args)
        assert (config.heartbeat_s, config.tick_s) == (0.02, 0.005)
    assert PEER.build(build_parser().parse_args(["peer"])).heartbeat_s == PeerConfig().heartbeat_s
