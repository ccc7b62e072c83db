"""Run a command where a real soft-RoCE device exists.

* On a kernel with ``rdma_rxe`` (distribution kernels, a BlueField): create
  the device natively (``rxe0`` on a dummy netdev ``rxed0`` at 10.223.0.1)
  and run the command here.
* On a kernel without it (our development and CI machines): boot Debian's
  stock kernel with virtme-ng under QEMU's software CPU (``--disable-kvm``:
  this host's KVM only runs PVM guests), over a read-only view of this
  filesystem, create the same device inside, run the command, and return its
  exit code. Writes survive only under the ``rwdirs`` given.

The address lives on a dummy device with no carrier to anywhere, so nothing
the tests send leaves the machine (or the VM).
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from dpu_frontend.transport.verbs.device import kernel_has_rxe

RXE_DEVICE = "rxe0"
RXE_NETDEV = "rxed0"
RXE_IP = "10.223.0.1"

#: Drivers that probe slowly under TCG and are useless in the micro-VM;
#: blacklisting them halves the boot.
VM_BLACKLIST = ("kvm,kvm_amd,kvm_intel,ahci,libahci,sr_mod,cdrom,i2c_i801,iTCO_wdt,pcspkr,"
                "lpc_ich,serio_raw,psmouse,joydev,evdev,button,powernow_k8,i6300esb,bochs,drm,"
                "qemu_fw_cfg")

SETUP_SCRIPT = f"""
set -e
modprobe rdma_rxe
modprobe dummy
ip link set lo up
if ! ip link show {RXE_NETDEV} >/dev/null 2>&1; then
  ip link add {RXE_NETDEV} type dummy
  ip addr add {RXE_IP}/24 dev {RXE_NETDEV}
fi
ip link set {RXE_NETDEV} up
rdma link show {RXE_DEVICE}/1 >/dev/null 2>&1 || rdma link add {RXE_DEVICE} type rxe netdev {RXE_NETDEV}
"""


def rxe_ready() -> bool:
    return Path(f"/sys/class/infiniband/{RXE_DEVICE}").is_dir()


def native_possible() -> bool:
    """True when this kernel can create an rxe device itself."""
    return rxe_ready() or kernel_has_rxe()


def stock_kernel() -> str:
    kernels = glob.glob("/boot/vmlinuz-*-amd64") + glob.glob("/boot/vmlinuz-*-arm64")
    if not kernels:
        raise RuntimeError("no Debian stock kernel in /boot: apt-get install linux-image-amd64 "
                           "(deploy/dev.sh does)")

    def version(path: str) -> list[int]:
        return [int(n) for n in re.findall(r"\d+", path)]

    return sorted(kernels, key=version)[-1]


def run_native(argv: Sequence[str]) -> int:
    if not rxe_ready():
        subprocess.run(["sh", "-c", SETUP_SCRIPT], check=True)
    return subprocess.call(list(argv))


def vm_command(argv: Sequence[str], *, cwd: str, path: str, rwdirs: Sequence[str],
               memory: str, cpus: int = 2) -> list[str]:
    vng = shutil.which("vng", path=path)
    if vng is None:
        raise RuntimeError("vng not found: pip install 'dpu-frontend[softroce]' (deploy/dev.sh does)")
    # The guest sees none of our environment: pass PATH and our own settings.
    forwarded = {k: v for k, v in os.environ.items() if k.startswith("DPU_FRONTEND_")}
    forwarded |= {"PATH": path, "HOME": "/tmp", "PYTHONDONTWRITEBYTECODE": "1",
                  "DPU_FRONTEND_IN_VM": "1"}
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(forwarded.items()))
    inner = (f"{SETUP_SCRIPT}\ncd {shlex.quote(cwd)}\nexport {exports}\n"
             + " ".join(shlex.quote(a) for a in argv))
    command = [vng, "--disable-kvm", "--run", stock_kernel(), "--memory", memory,
               "--cpus", str(cpus), "--append", f"modprobe.blacklist={VM_BLACKLIST}"]
    for rw in rwdirs:
        command += ["--rwdir", rw]
    return [*command, "--exec", f"bash -c {shlex.quote(inner)}"]


def run_vm(argv: Sequence[str], *, timeout: int, memory: str, rwdirs: Sequence[str]) -> int:
    # The guest does not inherit our environment: it gets an explicit PATH
    # with this interpreter's bin/ (the project venv) first.
    venv_bin = os.path.dirname(sys.executable)
    path = f"{venv_bin}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    command = vm_command(argv, cwd=os.getcwd(), path=path, rwdirs=rwdirs, memory=memory)
    env = dict(os.environ, PATH=f"{venv_bin}:{os.environ.get('PATH', '')}")
    # QEMU reopens a file stdout with truncation and loses lines: always pipe.
    with subprocess.Popen(["timeout", "--kill-after=30", str(timeout), *command],
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=env) as proc:
        for line in proc.stdout or ():
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
        return proc.wait()


#: ``dpu-frontend softroce --mode``: the first, natively where the kernel has rdma_rxe
#: and in the micro-VM elsewhere, is the default.
MODES = ("auto", "native", "vm")


def run_cli(mode: str, argv: Sequence[str], *, timeout: int, memory: str,
            rwdirs: Sequence[str] = ()) -> int:
    argv = list(argv)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("usage: dpu-frontend softroce [--mode auto|native|vm] -- COMMAND...",
              file=sys.stderr)
        return 2
    if mode == "auto":
        mode = "native" if native_possible() else "vm"
    print(f"softroce: running {'natively' if mode == 'native' else 'in the micro-VM'}: "
          f"{' '.join(argv)}", file=sys.stderr, flush=True)
    if mode == "native":
        return run_native(argv)
    return run_vm(argv, timeout=timeout, memory=memory, rwdirs=rwdirs)
