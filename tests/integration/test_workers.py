"""``serve --workers 2``: two processes, one port, a channel each, metrics summed over
both; a worker lost while no peer is up, and SIGTERM during its restart."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from pathlib import Path

import aiohttp
import trustme

from dpu_frontend.control.stats import peer_stats
from dpu_frontend.softroce.processes import CLI
from tests.integration.lifecycle import endings, eventually, outcome, read_events
from tests.integration.test_metrics import PROMTOOL
from tests.stack import MODEL, Stack, running_stack
from tests.tls import Files, handshake, served, trusting

REQUESTS = 24
#: --drain-timeout 5: the supervisor gives its workers 5 + 5 (close) + 5 s, then SIGKILL.
DRAIN = ("--drain-timeout", "5")
GRACE_S = 15


async def test_two_workers_share_the_port_and_aggregate_metrics() -> None:
    # --port 0: the supervisor reserves a port the kernel picks and hands it to both.
    with running_stack("shm", tokens_per_s=200, timeout=120, peer_args=("--channels", "2"),
                       serve_args=("--workers", "2")) as stack:
        body = {"model": MODEL, "prompt": "workers", "max_tokens": 6, "stream": True}

        async def one(i: int) -> str:
            # A connection each: the kernel spreads connections over the workers.
            async with aiohttp.ClientSession() as http, http.post(
                    f"{stack.base_url}/v1/completions", json=body | {"prompt": f"w {i}"}) as r:
                return outcome(await read_events(r))

        assert await asyncio.gather(*(one(i) for i in range(REQUESTS))) == ["finished"] * REQUESTS
        channels = await peer_stats(stack.peer_address())
        assert [c["attached"] for c in channels] == [True, True]  # one channel per worker
        assert sum(c["admitted"] for c in channels) == REQUESTS
        assert all(c["admitted"] > 0 for c in channels), channels
        # The operator's view, from the CLI: the channels, and the kernel's own counters
        # (none for the reference generator; a model peer's engine has them).
        cli = await asyncio.create_subprocess_exec(
            *CLI, "peer-stats", "--peer", str(stack.peer_address()),
            stdout=asyncio.subprocess.PIPE)
        report = json.loads((await cli.communicate())[0])
        assert cli.returncode == 0 and report["kernel"] == {}
        assert [c["admitted"] for c in report["channels"]] == [c["admitted"] for c in channels]

        # Each worker set its gauges before its ready line: no wait for a refresh.
        async with aiohttp.ClientSession() as http, http.get(f"{stack.base_url}/metrics") as r:
            text = await r.text()
        total = re.search(r'^dpu_frontend_requests_total\{endpoint="/v1/completions",'
                          r'finish_reason="length",status="200"\} ([0-9.]+)$', text, re.MULTILINE)
        assert total and float(total.group(1)) == REQUESTS  # summed over both workers
        up = re.search(r'^dpu_frontend_peer_up\{peer="[^"]+"\} ([0-9.]+)$', text, re.MULTILINE)
        assert up and float(up.group(1)) == 1
        check = await asyncio.create_subprocess_exec(
            PROMTOOL, "check", "metrics", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await check.communicate(text.encode())
        assert check.returncode == 0, (out + err).decode()
        stack.daemon.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(stack.daemon.wait, 60) == 0


def workers_of(supervisor: int) -> set[int]:
    """The supervisor's child processes: its workers, and a worker being started."""
    return {int(pid) for pid in
            Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()}


def gone(pid: int) -> bool:
    """Exited (a zombie not reaped yet counts: it runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


async def both_serve(stack: Stack) -> bool:
    """One more request, on a connection of its own: has each worker's channel taken one?"""
    body = {"model": MODEL, "prompt": "which worker?", "max_tokens": 1}
    async with aiohttp.ClientSession() as http, http.post(
            f"{stack.base_url}/v1/completions", json=body) as r:
        await r.read()  # a 503 while a link is still coming back is fine: try again
    return all(c["admitted"] > 0 for c in await peer_stats(stack.peer_address()))


async def test_a_worker_lost_while_no_peer_is_up_comes_back_with_the_peer() -> None:
    """Its restarts fail while the peer is down, and are retried; the other worker
    answers all along; both serve once the peer is back; SIGTERM drains."""
    with running_stack("shm", tokens_per_s=50, timeout=120, peer_args=("--channels", "2"),
                       serve_args=("--workers", "2", *DRAIN)) as stack:
        supervisor = stack.daemon.pid
        lost, survivor = sorted(workers_of(supervisor))
        stack.peers[0].kill()
        os.kill(lost, signal.SIGKILL)
        attempts: set[int] = set()

        async def an_attempt_failed() -> bool:
            now = workers_of(supervisor) - {lost, survivor}
            attempts.update(now)
            return bool(attempts - now)  # one came and went: no peer to connect to

        await eventually(an_attempt_failed, "no restart attempt came and went")
        assert survivor in workers_of(supervisor) and stack.daemon.poll() is None
        async with aiohttp.ClientSession() as http:
            for _ in range(4):  # only the survivor listens: each connection is its
                async with http.get(f"{stack.base_url}/health") as r:
                    assert r.status == 503 and (await r.json())["peers"][0]["up"] is False

        stack.peers[0].restart()  # a new peer: its counters start at 0
        await eventually(lambda: both_serve(stack), "the workers never both served again")
        assert len(workers_of(supervisor)) == 2 and survivor in workers_of(supervisor)
        body = {"model": MODEL, "prompt": "back", "max_tokens": 2, "stream": True}

        async def one(i: int) -> str:
            async with aiohttp.ClientSession() as http, http.post(
                    f"{stack.base_url}/v1/completions", json=body | {"prompt": f"b {i}"}) as r:
                return outcome(await read_events(r))

        assert await asyncio.gather(*(one(i) for i in range(REQUESTS))) == ["finished"] * REQUESTS

        # SIGTERM under an open stream: it finishes (the workers drain), exit status 0.
        async with aiohttp.ClientSession() as http, http.post(
                f"{stack.base_url}/v1/completions",
                json={"model": MODEL, "prompt": "last", "max_tokens": 100, "stream": True,
                      "ignore_eos": True}) as r:
            assert (await r.content.readline()).startswith(b"data: {")
            stack.daemon.send_signal(signal.SIGTERM)
            events = await read_events(r)
        assert endings(events) == ["finish_reason", "[DONE]"]
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert await asyncio.to_thread(stack.daemon.wait, GRACE_S) == 0


async def test_sigterm_ends_a_restart_attempt_at_once() -> None:
    """A worker restarted while the peer is stopped (alive, silent) waits for its
    handshake for the whole --connect-timeout: SIGTERM does not wait for it."""
    with running_stack("shm", timeout=120, peer_args=("--channels", "2"),
                       serve_args=("--workers", "2", *DRAIN, "--connect-timeout", "300")) as stack:
        supervisor = stack.daemon.pid
        lost, survivor = sorted(workers_of(supervisor))
        stack.peers[0].kill(signal.SIGSTOP)
        try:
            os.kill(lost, signal.SIGKILL)
            attempts: set[int] = set()

            async def attempting() -> bool:
                attempts.update(workers_of(supervisor) - {lost, survivor})
                return bool(attempts)

            await eventually(attempting, "no restart attempt")
            stack.daemon.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(stack.daemon.wait, GRACE_S) == 0

            async def all_gone() -> bool:
                return all(gone(pid) for pid in {survivor, *attempts})

            await eventually(all_gone, "a worker outlived the supervisor", limit=10)
        finally:
            stack.peers[0].kill(signal.SIGCONT)


async def test_sighup_reloads_the_api_keys_of_every_worker(tmp_path: Path) -> None:
    """The supervisor forwards SIGHUP: after the key file changes, the new key works and
    the old one is refused, on every connection (the kernel spreads them over both)."""
    keys = tmp_path / "api-keys"
    keys.write_text("old-key-0123456789abcdef\n")
    keys.chmod(0o600)
    with running_stack("shm", timeout=120, peer_args=("--channels", "2"),
                       serve_args=("--workers", "2", "--api-key-file", str(keys))) as stack:
        async def statuses(key: str) -> list[int]:
            async def one() -> int:
                # A session each: a new connection, so both workers answer some.
                async with aiohttp.ClientSession() as http, http.get(
                        f"{stack.base_url}/v1/models",
                        headers={"Authorization": f"Bearer {key}"}) as r:
                    return r.status
            return list(await asyncio.gather(*(one() for _ in range(16))))

        assert await statuses("old-key-0123456789abcdef") == [200] * 16
        keys.write_text("new-key-0123456789abcdef\n")
        stack.daemon.send_signal(signal.SIGHUP)

        async def reloaded() -> bool:
            return await statuses("new-key-0123456789abcdef") == [200] * 16

        await eventually(reloaded, "a worker never reloaded its keys")
        assert await statuses("old-key-0123456789abcdef") == [401] * 16


async def test_sighup_rotates_the_tls_certificate_of_every_worker_and_keeps_open_streams(
        tmp_path: Path) -> None:
    """HTTPS with two workers: after the files change and SIGHUP, every new connection is
    served the new certificate, while a stream opened before runs to its end."""
    ca = trustme.CA()
    files = Files(tmp_path / "cert.pem", tmp_path / "key.pem")
    old = files.install(ca.issue_cert("127.0.0.1"))
    trust = trusting(ca)
    with running_stack("shm", tokens_per_s=20, timeout=120, peer_args=("--channels", "2"),
                       serve_args=("--workers", "2", "--tls-cert-file", str(files.cert),
                                   "--tls-key-file", str(files.key))) as stack:
        assert stack.base_url.startswith("https://")

        async def certificates() -> set[str]:
            return set(await asyncio.gather(*(handshake(stack.base_url, trust)
                                              for _ in range(16))))

        assert await certificates() == {old}
        body = {"model": MODEL, "prompt": "rotate", "max_tokens": 40, "stream": True}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trust)) as http, \
                http.post(f"{stack.base_url}/v1/completions", json=body) as before:
            assert served(before) == old
            new = files.install(ca.issue_cert("127.0.0.1"))
            stack.daemon.send_signal(signal.SIGHUP)

            async def rotated() -> bool:
                return await certificates() == {new}

            await eventually(rotated, "a worker never reloaded its certificate", limit=30)
            assert outcome(await read_events(before)) == "finished"
