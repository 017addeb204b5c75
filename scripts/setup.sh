#!/usr/bin/env bash
# Install megatron-ft and everything it needs on a fresh machine (CPU, Python 3.11).
# torch==2.13.0 is pinned: on these machines pip takes the CPU build already on disk.
# GPU machines: install the CUDA build of torch 2.13.0 first (README, "GPU machines").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# ISA-L (Debian libisal2) for the fast Reed-Solomon codec (issue 3). Optional: without it the
# rs codec falls back to the slower numpy bit-matrix code, and says so.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ] && ! dpkg -s libisal2 >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -qq libisal2 || { apt-get update -qq && apt-get install -y -qq libisal2; }; } >/dev/null 2>&1 \
        || echo "note: could not install libisal2 (ISA-L); Reed-Solomon will use the slower numpy codec"
fi

# etcd (Debian etcd-server, 3.4.x) for `health.store: etcd://HOST:PORT` and the tests that start
# a real etcd server (tests/test_health.py; skipped without the binary). Optional like libisal2.
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ] && ! dpkg -s etcd-server >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -qq etcd-server || { apt-get update -qq && apt-get install -y -qq etcd-server; }; } >/dev/null 2>&1 \
        || echo "note: could not install etcd-server; health.store etcd:// tests will be skipped"
elif ! command -v etcd >/dev/null 2>&1; then
    echo "note: no etcd binary and cannot apt-get install etcd-server here (needs root + apt); etcd tests will be skipped"
fi

# deepspeed (optional extra) is pure Python here: DS_BUILD_OPS=0 skips its CUDA/C++ op builds
DS_BUILD_OPS=0 "$PY" -m pip install --disable-pip-version-check -q -e ".[test,deepspeed,etcd]"
"$PY" -c "import megatron_ft.checksum as c; print('megatron-ft installed; native copy+checksum:', c.HAVE_NATIVE)"
