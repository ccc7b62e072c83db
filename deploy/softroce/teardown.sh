#!/usr/bin/env bash
# Remove what deploy/softroce/setup.sh created.
set -euo pipefail
DEVICE=${RXE_DEVICE:-rxe0}
rdma link delete "$DEVICE" 2>/dev/null || true
ip link delete rxed0 2>/dev/null || true
