"""The arm64 lane: the unit tests and one end-to-end shm stream on aarch64, under qemu-user.

The daemon is for a BlueField's Arm cores. This lane runs it there as far as a
development machine can: a Debian 12 arm64 root (debootstrap's first stage,
its packages unpacked here rather than configured under emulation: 30 s
instead of 4-5 minutes), the aarch64 wheels of the dependencies from PyPI
(``pip --platform``, installed here, nothing built), and ``qemu-aarch64``
through ``binfmt_misc``, which this kernel can mount. The repository is
bound at its own path inside the root, in a private mount namespace, so
nothing stays mounted after the run.

    python -m tests.tools.arm64 --build build/arm64 --junit build/arm64-junit.xml [PYTEST ARGS]

The root and the wheels are kept under ``--build`` and reused while the
package list and the requirements are unchanged.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from dpu_frontend.text.assets import installed_dir

ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
#: What the daemon needs on a BlueField (as deploy/bluefield/install.sh installs it),
#: and gcc for the C header's layout check on this architecture.
PACKAGES = ("python3", "python3-venv", "python3-pyverbs", "libatomic1", "gcc", "libc6-dev",
            "ca-certificates")
#: Linters and the schema fuzzer do not run here, nor the reference chat renderer.
NOT_HERE = {"ruff", "mypy", "schemathesis", "transformers"}
PLATFORMS = ("manylinux2014_aarch64", "manylinux_2_17_aarch64", "manylinux_2_28_aarch64",
             "manylinux_2_34_aarch64", "musllinux_1_1_aarch64")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
QEMU_RULE = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")
#: The subset CI runs: the unit tests, and one streamed completion through a real daemon
#: and peer over shm with the openai SDK. Not the chat templates against transformers'
#: renderer: pure Python on both sides, and importing transformers under emulation
#: costs half a minute of CI.
TESTS = ("tests/unit", "--ignore=tests/unit/test_chat_template.py",
         "tests/integration/test_completion_shm.py")


def requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    return [r for r in wanted if r.split(">")[0].split("=")[0].split("<")[0] not in NOT_HERE]


def run(*argv: str | Path, **kwargs: object) -> None:
    print("+", " ".join(shlex.quote(str(a)) for a in argv), flush=True)
    subprocess.run([str(a) for a in argv], check=True, **kwargs)  # type: ignore[call-overload]


def enable_binfmt() -> None:
    """qemu-aarch64 as the interpreter of aarch64 ELF files (F: opened now, so it works
    inside the chroot)."""
    if not (BINFMT / "register").exists():
        run("mount", "-t", "binfmt_misc", "binfmt_misc", BINFMT)
    if not (BINFMT / "qemu-aarch64").exists():
        if not QEMU_RULE.exists():
            raise SystemExit(f"{QEMU_RULE} is missing: apt-get install qemu-user-static")
        (BINFMT / "register").write_text(QEMU_RULE.read_text().strip())


def build_root(root: Path) -> None:
    stamp = root / ".dpu-frontend-root"
    wanted = " ".join((SUITE, *PACKAGES))
    if stamp.exists() and stamp.read_text() == wanted:
        return
    shutil.rmtree(root, ignore_errors=True)
    run("debootstrap", "--foreign", "--arch=arm64", "--variant=minbase",
        f"--include={','.join(PACKAGES)}", SUITE, root, MIRROR, stdout=subprocess.DEVNULL)
    # The second stage would configure every package under emulation (minutes): unpacking
    # them all here gives a root that runs Python, gcc and pyverbs.
    for deb in sorted((root / "var/cache/apt/archives").glob("*.deb")):
        run("dpkg-deb", "-x", deb, root)
    stamp.write_text(wanted)


def build_site(site: Path) -> None:
    wanted = requirements()
    stamp = site / ".dpu-frontend-site"
    digest = hashlib.sha256("\n".join(wanted).encode()).hexdigest()
    if stamp.exists() and stamp.read_text() == digest:
        return
    shutil.rmtree(site, ignore_errors=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    run(sys.executable, "-m", "pip", "install", "-q", "--target", site, *platforms,
        "--implementation", "cp", "--python-version", "3.11", "--only-binary=:all:", *wanted)
    stamp.write_text(digest)


def install_tokenizer(root: Path) -> None:
    """The bundled tokenizer's two files, where the root's python3 looks (sys.prefix /usr)."""
    target = root / "usr/share/dpu-frontend/tokenizers/qwen3"
    shutil.copytree(installed_dir(), target, dirs_exist_ok=True)


def in_root(root: Path, site: Path, command: list[str]) -> int:
    """``command`` in the root, as root, from the repository's directory."""
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": f"/opt/site:{ROOT}",
           "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8",
           **{k: v for k, v in os.environ.items() if k.startswith("DPU_FRONTEND_")}}
    # The repository last: a checkout under /tmp must not be hidden by the root's /tmp.
    mounts = [("-t proc", "proc", root / "proc"), ("--bind", "/dev", root / "dev"),
              ("-t tmpfs", "tmpfs", root / "dev/shm"), ("-t tmpfs", "tmpfs", root / "tmp"),
              ("--bind", site, root / "opt/site"), ("--bind", ROOT, root / str(ROOT).lstrip("/"))]
    script = ["set -e"]
    for kind, source, target in mounts:
        script.append(f"mkdir -p {shlex.quote(str(target))}")
        script.append(f"mount {kind} {shlex.quote(str(source))} {shlex.quote(str(target))}")
    exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    script.append(f"exec chroot {shlex.quote(str(root))} /usr/bin/env -i {exports} sh -c "
                  + shlex.quote(f"cd {shlex.quote(str(ROOT))} && "
                                + " ".join(shlex.quote(c) for c in command)))
    return subprocess.call(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            "\n".join(script)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build", type=Path, default=ROOT / "build/arm64")
    parser.add_argument("--junit", type=Path)
    args, pytest_args = parser.parse_known_args()
    build = args.build.resolve()
    enable_binfmt()
    build_root(build / "root")
    build_site(build / "site")
    install_tokenizer(build / "root")
    junit = [f"--junitxml={args.junit.resolve()}"] if args.junit else []
    machine = subprocess.run(["chroot", str(build / "root"), "/usr/bin/uname", "-m"],
                             capture_output=True, text=True, check=True).stdout.strip()
    if machine != "aarch64":
        raise SystemExit(f"the root runs as {machine}, not aarch64: is binfmt_misc set up?")
    return in_root(build / "root", build / "site",
                   ["python3", "-m", "pytest", "-p", "no:cacheprovider", "-m",
                    "not rdma and not gpu", *junit, *(pytest_args or TESTS)])


if __name__ == "__main__":
    sys.exit(main())
