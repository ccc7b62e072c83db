"""``dpu-frontend check``: what a deployment needs, each problem with its fix.

RDMA devices and port state (and whether ``rdma_rxe`` could provide one),
``RLIMIT_MEMLOCK`` against the memory the daemon will register, the tokenizer
and chat template, and each configured GPU peer: reachable, handshake and
layout record accepted (protocol version, geometry). Exit status 1 when
anything the configuration needs is missing.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

from dpu_frontend.config import ServeConfig
from dpu_frontend.engine.session import PeerSession, staging_bytes_for
from dpu_frontend.errors import DpuFrontendError
from dpu_frontend.ring import Geometry
from dpu_frontend.text.assets import default_tokenizer_dir
from dpu_frontend.text.chat_template import load_chat_template
from dpu_frontend.text.tokenizer import Vocabulary
from dpu_frontend.transport.factory import transport_class
from dpu_frontend.transport.verbs import compat
from dpu_frontend.transport.verbs.device import SYSFS, gid_table, kernel_has_rxe, resolve

OK, FAIL, INFO = "ok", "FAIL", "info"


@dataclass(frozen=True, slots=True)
class Finding:
    status: str
    what: str
    fix: str = ""

    def render(self) -> str:
        line = f"[{self.status:^4}] {self.what}"
        return line + (f"\n       fix: {self.fix}" if self.fix else "")


def rdma(config: ServeConfig, sysfs: Path = SYSFS) -> list[Finding]:
    needed = transport_class(config).rdma
    found = []
    table = gid_table(sysfs)
    for device in sorted({e.device for e in table}):
        state = Path(sysfs / device / "ports" / "1" / "state")
        port = state.read_text().strip() if state.is_file() else "unknown"
        gids = ", ".join(f"{e.ipv4 or e.gid} [{e.index}]" for e in table
                         if e.device == device and e.kind == "RoCE v2")
        found.append(Finding(OK if "ACTIVE" in port else FAIL,
                             f"RDMA device {device}: port 1 {port}; RoCE v2 GIDs {gids or 'none'}",
                             "" if "ACTIVE" in port else f"bring up the netdev under {device}"))
    if not table:
        if kernel_has_rxe():
            rxe, fix = "this kernel has rdma_rxe", "deploy/softroce/setup.sh creates rxe0"
        else:
            rxe, fix = "this kernel has no rdma_rxe", (
                "run under `dpu-frontend softroce -- ...` (a micro-VM with a stock kernel), "
                "or use transport shm for development")
        found.append(Finding(FAIL if needed else INFO, f"no RDMA device; {rxe}",
                             f"on a BlueField: load mlx5_ib and check `rdma link`; {fix}"
                             if needed else ""))
    if needed:
        if not compat.available():
            found.append(Finding(FAIL, compat.IMPORT_ERROR or "pyverbs missing",
                                 "apt-get install python3-pyverbs (DOCA: its rdma-core)"))
        if table:
            try:
                entry = resolve(config.rdma.device, config.rdma.ip, sysfs)
                found.append(Finding(OK, f"will use {entry.device} port {entry.port} GID index "
                                         f"{entry.index} ({entry.ipv4 or entry.gid})"))
            except DpuFrontendError as exc:
                found.append(Finding(FAIL, str(exc), "set rdma_ip/rdma_device to a RoCE v2 GID "
                                                     "listed above"))
    return found


def memlock(config: ServeConfig, per_peer: int | None = None) -> Finding:
    """Registration pins pages: the limit must cover the staging buffer of every peer."""
    if not transport_class(config).rdma:
        return Finding(INFO, f"{config.transport} transport: no memory registration")
    need = len(config.peers) * (per_peer or staging_bytes_for(Geometry().plan(1).channels[0]))
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if os.geteuid() == 0 or soft == resource.RLIM_INFINITY or soft >= need:
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 10} KiB"
        return Finding(OK, f"RLIMIT_MEMLOCK {limit}{' (root)' if os.geteuid() == 0 else ''} "
                           f"covers ~{need >> 10} KiB to register")
    return Finding(FAIL, f"RLIMIT_MEMLOCK {soft >> 10} KiB < ~{need >> 10} KiB to register",
                   "LimitMEMLOCK=infinity in the unit, or `ulimit -l unlimited`")


def text(config: ServeConfig) -> list[Finding]:
    try:
        vocab = Vocabulary.load(config.tokenizer or default_tokenizer_dir())
        template = load_chat_template(vocab, config.chat_template)
    except DpuFrontendError as exc:
        return [Finding(FAIL, str(exc), "set tokenizer (and chat_template) to readable files")]
    return [Finding(OK, f"tokenizer {vocab.source}: {vocab.tokenizer.get_vocab_size()} tokens, "
                        f"EOS {list(vocab.eos_token_ids)}, context {vocab.model_max_length}"),
            Finding(OK if template else INFO,
                    f"chat template {template.origin}" if template else
                    "no chat template: /v1/chat/completions will answer 400",
                    "" if template else "set chat_template to a .jinja file")]


async def peers(config: ServeConfig) -> tuple[list[Finding], int]:
    found, largest = [], 0
    for address in config.peers:
        try:
            session = await PeerSession.connect(config, address)
        except DpuFrontendError as exc:
            found.append(Finding(FAIL, f"GPU peer {address}: {exc}",
                                 "start the peer, check the address and the firewall "
                                 "(TCP control port), and that both speak the same protocol"))
            continue
        try:
            layout, channel = session.layout, session.channel
            if layout is not None:
                lay = channel.layout
                largest = max(largest, staging_bytes_for(lay))
                found.append(Finding(OK, f"GPU peer {address}: protocol v{layout.version_major}."
                                         f"{layout.version_minor}, channel {session.channel_index}"
                                         f" of {len(layout.channels)}, {lay.req_slots} request "
                                         f"slots, prompts of up to {lay.max_prompt_tokens} "
                                         f"tokens, {lay.resp_slots} x "
                                         f"{lay.tokens_per_response}-token response records, "
                                         + (f"log probabilities ({lay.max_top_logprobs} "
                                            "alternatives)" if lay.logprobs else
                                            "no log probabilities") + ", " + (
                                             "structured output (automata up to "
                                             f"{lay.max_automaton_bytes} bytes)"
                                             if lay.constraints else "no structured output")))
        finally:
            await session.close()
    return found, largest


async def run_check(config: ServeConfig) -> int:
    findings = [*rdma(config), *text(config)]
    peer_findings, staging = await peers(config)
    findings += [memlock(config, staging or None), *peer_findings]
    for finding in findings:
        print(finding.render(), flush=True)
    failed = sum(f.status == FAIL for f in findings)
    print(f"\n{failed} problem(s) found" if failed else "\nready to serve")
    return 1 if failed else 0
