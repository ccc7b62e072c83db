"""Ask a GPU peer for its counters over the control plane (``dpu-frontend peer-stats``)."""

from __future__ import annotations

import asyncio
from typing import Any

from dpu_frontend.config import PeerAddress
from dpu_frontend.control import messages
from dpu_frontend.errors import PeerError

TIMEOUT_S = 10.0


async def peer_stats(address: PeerAddress) -> list[dict[str, Any]]:
    """Each channel's counters: attached, active request ids, admitted, completed, cancelled..."""
    channels: list[dict[str, Any]] = (await peer_report(address))["channels"]
    return channels


async def peer_report(address: PeerAddress) -> dict[str, Any]:
    """The whole answer: ``channels`` (``peer_stats``) and ``kernel``, the counters of the
    kernel as a whole (a model peer's engine: steps, tokens, where the time goes)."""
    try:
        async with asyncio.timeout(TIMEOUT_S):
            reader, writer = await asyncio.open_connection(address.host, address.port)
            try:
                await messages.send(writer, {"op": "stats"})
                answer = await messages.receive(reader)
            finally:
                writer.close()
                await writer.wait_closed()
    except (OSError, TimeoutError) as exc:
        raise PeerError(f"cannot get stats from GPU peer {address}: {exc}") from exc
    channels, kernel = answer.get("channels"), answer.get("kernel", {})
    if answer.get("op") != "stats" or not isinstance(channels, list) or not isinstance(kernel, dict):
        raise PeerError(f"GPU peer {address} answered {answer.get('op')!r} to stats")
    return {"channels": channels, "kernel": kernel}
