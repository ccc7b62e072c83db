"""RDMA resources in one class with overridable steps.

The daemon and the reference peer both open a device, a PD, a CQ, register
memory and bring RC QPs to RTS; they differ only in what they register and in
who posts work. Steps are methods (``create_cq``, ``create_qp``, ``to_rts``)
so either side can override one, after rdma-core's ``tests/base.py``.
Teardown is in reverse order of creation: QPs, MRs, CQ, PD, context.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpu_frontend.errors import StartupError, TransportError
from dpu_frontend.transport.verbs import compat
from dpu_frontend.transport.verbs.device import SYSFS, GidEntry, resolve

log = logging.getLogger("dpu_frontend.rdma")

# RC connection attributes. Named so that an operator reading a packet trace
# or an mlx5 counter can map them back.
TIMEOUT = 14  # local ACK timeout: 4.096 us * 2**14 = 67 ms per retry
# soft-RoCE answers from a CPU's softirq, and a busy or emulated CPU (the test micro-VM)
# delays answers past 67 ms: the requester then retransmits answers that were only late.
# Under QEMU's software CPU that cost 0.5 s batches, and rxe's retry path (Debian 12's
# 6.1 kernel) once left a batch that never completed. 2**18 (1.07 s, NCCL's default
# timeout) made the retransmissions disappear there (docs/reliability.md).
TIMEOUT_SOFT_ROCE = 18
RXE_VENDOR_ID = 0xFFFFFF  # what rdma_rxe reports as its vendor
RETRY_CNT = 7  # transport retries before the QP goes to error
RNR_RETRY = 7  # 7 = retry forever on receiver-not-ready (we post no receives anyway)
MIN_RNR_TIMER = 12
MAX_RD_ATOMIC = 16  # outstanding RDMA READs per QP (capped by the device)
HOP_LIMIT = 64
SQ_DEPTH = 512
CQ_DEPTH = 1024


def access_flags(*, remote: bool) -> int:
    flags: int = compat.enum("IBV_ACCESS_LOCAL_WRITE")
    if remote:
        flags |= compat.enum("IBV_ACCESS_REMOTE_READ") | compat.enum("IBV_ACCESS_REMOTE_WRITE")
    return flags


@dataclass(frozen=True, slots=True)
class QpInfo:
    """What each side tells the other to connect an RC QP (over the control plane)."""

    qpn: int
    psn: int
    gid: str

    def to_dict(self) -> dict[str, Any]:
        return {"qpn": self.qpn, "psn": self.psn, "gid": self.gid}

    @classmethod
    def from_dict(cls, data: Any) -> QpInfo:
        try:
            qpn, psn, gid = data["qpn"], data["psn"], data["gid"]
        except (KeyError, TypeError) as exc:
            raise TransportError(f"malformed QP description {data!r}") from exc
        if not (isinstance(qpn, int) and isinstance(psn, int) and isinstance(gid, str)):
            raise TransportError(f"malformed QP description {data!r}")
        return cls(qpn, psn & 0xFFFFFF, gid)


class RdmaResources:
    """Context, PD and CQ on one port, plus the MRs and QPs made from them."""

    def __init__(self, device: str | None = None, ip: str | None = None,
                 sysfs: Path = SYSFS) -> None:
        self.device = device
        self.ip = ip
        self.sysfs = sysfs
        self.gid: GidEntry | None = None
        self.ctx: Any = None
        self.pd: Any = None
        self.cq: Any = None
        self.active_mtu: int = 0
        self.max_rd_atomic = MAX_RD_ATOMIC
        self.ack_timeout = TIMEOUT
        self._mrs: list[Any] = []
        self._qps: list[Any] = []

    def open(self) -> None:
        if not compat.available():
            raise StartupError(compat.IMPORT_ERROR or "pyverbs is not available")
        self.gid = resolve(self.device, self.ip, self.sysfs)
        device_mod = compat.module("device")
        try:
            self.ctx = device_mod.Context(name=self.gid.device)
            port = self.ctx.query_port(self.gid.port)
            if port.state != compat.enum("IBV_PORT_ACTIVE"):
                raise StartupError(f"{self.gid.device} port {self.gid.port} is not ACTIVE "
                                   "(rdma link show)")
            self.active_mtu = port.active_mtu
            attr = self.ctx.query_device()
            self.max_rd_atomic = max(1, min(MAX_RD_ATOMIC, attr.max_qp_rd_atom,
                                            attr.max_qp_init_rd_atom))
            self.ack_timeout = TIMEOUT_SOFT_ROCE if attr.vendor_id == RXE_VENDOR_ID else TIMEOUT
            self.pd = compat.module("pd").PD(self.ctx)
            self.cq = self.create_cq()
        except compat.module("errors").PyverbsError as exc:
            self.close()
            raise StartupError(f"cannot open RDMA device {self.gid.device}: {exc}") from exc
        log.info("opened %s port %d gid[%d]=%s mtu=%d ack timeout %.0f ms", self.gid.device,
                 self.gid.port, self.gid.index, self.gid.gid, 128 << self.active_mtu,
                 4.096e-3 * 2**self.ack_timeout)

    def create_cq(self) -> Any:
        return compat.module("cq").CQ(self.ctx, CQ_DEPTH, None, None, 0)

    def register(self, address: int, length: int, *, remote: bool) -> Any:
        """Register memory the caller owns (an mmap). ``remote`` opens it to peers' READ/WRITE.

        Relaxed ordering is deliberately not requested: the protocol relies on
        the WRITEs of one QP reaching memory in order (docs/protocol.md).
        """
        access = access_flags(remote=remote)
        try:
            mr = compat.module("mr").MR(self.pd, length, access, address=address)
        except compat.module("errors").PyverbsError as exc:
            raise StartupError(
                f"cannot register {length} bytes ({exc}); raise RLIMIT_MEMLOCK "
                "(LimitMEMLOCK=infinity in the unit, ulimit -l unlimited)"
            ) from exc
        self._mrs.append(mr)
        return mr

    def keep(self, mr: Any) -> Any:
        """Close ``mr`` (registered elsewhere, e.g. GPU memory) with these resources."""
        self._mrs.append(mr)
        return mr

    def create_qp(self) -> Any:
        qp_mod = compat.module("qp")
        cap = qp_mod.QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = qp_mod.QPInitAttr(qp_type=compat.enum("IBV_QPT_RC"), scq=self.cq, rcq=self.cq,
                                 cap=cap, sq_sig_all=0)
        qp = qp_mod.QP(self.pd, init)
        self._qps.append(qp)
        return qp

    def local_info(self, qp: Any, psn: int | None = None) -> QpInfo:
        if self.gid is None:
            raise StartupError("resources not opened")
        return QpInfo(qp.qp_num, secrets.randbits(24) if psn is None else psn, self.gid.gid)

    def to_rts(self, qp: Any, local: QpInfo, remote: QpInfo) -> None:
        """RESET -> INIT -> RTR -> RTS against ``remote``."""
        if self.gid is None:
            raise StartupError("resources not opened")
        addr = compat.module("addr")
        attr = compat.module("qp").QPAttr()
        attr.qp_access_flags = access_flags(remote=True)
        attr.port_num = self.gid.port
        attr.path_mtu = self.active_mtu
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = local.psn
        attr.max_dest_rd_atomic = self.max_rd_atomic
        attr.max_rd_atomic = self.max_rd_atomic
        attr.min_rnr_timer = MIN_RNR_TIMER
        attr.timeout = self.ack_timeout
        attr.retry_cnt = RETRY_CNT
        attr.rnr_retry = RNR_RETRY
        route = addr.GlobalRoute(dgid=addr.GID(remote.gid), sgid_index=self.gid.index,
                                 hop_limit=HOP_LIMIT)
        attr.ah_attr = addr.AHAttr(port_num=self.gid.port, is_global=1, gr=route)
        try:
            qp.to_rts(attr)
        except compat.module("errors").PyverbsError as exc:
            raise TransportError(f"cannot connect QP {local.qpn} to {remote}: {exc}") from exc

    def deregister(self, mr: Any) -> None:
        if mr in self._mrs:
            self._mrs.remove(mr)
            mr.close()

    def destroy_qp(self, qp: Any) -> None:
        if qp in self._qps:
            self._qps.remove(qp)
            qp.close()

    def close(self) -> None:
        """QPs, MRs, CQ, PD, context: each closed even if one before it fails."""
        objects = [*reversed(self._qps), *reversed(self._mrs), self.cq, self.pd, self.ctx]
        self._qps, self._mrs = [], []
        self.cq = self.pd = self.ctx = None
        for obj in objects:
            if obj is None:
                continue
            try:
                obj.close()
            except compat.module("errors").PyverbsError as exc:
                log.error("closing %s failed: %s", type(obj).__name__, exc)
