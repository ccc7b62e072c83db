#!/usr/bin/env bash
# Create a soft-RoCE device on a host whose kernel has rdma_rxe (most
# distribution kernels). Idempotent.
#
#   deploy/softroce/setup.sh                  # rxe0 on a dummy netdev at 10.223.0.1/24
#   deploy/softroce/setup.sh --netdev eth0    # rxe0 on an existing interface
#
# With a dummy netdev nothing leaves the machine: daemon and peer both use
# the same rxe0 and the same address. With a real netdev, two hosts can talk
# RoCE v2 over UDP 4791 like a BlueField and a GPU server would.
set -euo pipefail

DEVICE=${RXE_DEVICE:-rxe0}
NETDEV=""
ADDRESS=${RXE_ADDRESS:-10.223.0.1/24}

while [ $# -gt 0 ]; do
  case "$1" in
    --netdev) NETDEV=$2; shift 2 ;;
    --device) DEVICE=$2; shift 2 ;;
    --address) ADDRESS=$2; shift 2 ;;
    *) echo "usage: $0 [--netdev IF] [--device NAME] [--address CIDR]" >&2; exit 2 ;;
  esac
done

if ! modprobe rdma_rxe 2>/dev/null; then
  echo "this kernel has no rdma_rxe module; on our development machines use" >&2
  echo "  dpu-frontend softroce -- COMMAND   (boots a micro-VM with a stock kernel)" >&2
  exit 1
fi

if [ -z "$NETDEV" ]; then
  NETDEV=rxed0
  modprobe dummy
  ip link show "$NETDEV" >/dev/null 2>&1 || ip link add "$NETDEV" type dummy
  ip addr show dev "$NETDEV" | grep -q "inet ${ADDRESS%/*}/" || ip addr add "$ADDRESS" dev "$NETDEV"
  ip link set "$NETDEV" up
fi

if rdma link show "$DEVICE/1" >/dev/null 2>&1; then
  echo "$DEVICE already exists"
else
  rdma link add "$DEVICE" type rxe netdev "$NETDEV"
fi
rdma link show "$DEVICE/1"
echo "GIDs (use the RoCE v2 one of your address with --rdma-ip):"
for g in /sys/class/infiniband/"$DEVICE"/ports/1/gids/*; do
  i=${g##*/}
  t=$(cat "/sys/class/infiniband/$DEVICE/ports/1/gid_attrs/types/$i" 2>/dev/null) || continue
  printf '  [%s] %s %s\n' "$i" "$(cat "$g")" "$t"
done
