#!/usr/bin/env bash
# Install megatron-ft with every extra on a fresh machine (CPU, Python 3.11): what the demo and the
# tests need, into a virtual environment of its own (default ./.venv, created without the system's
# site packages, so nothing the machine happens to carry can stand in for a missing install step).
# Then use it: `source .venv/bin/activate` (or .venv/bin/megatron-ft ...).
#   MFT_VENV=DIR   the virtual environment to create or reuse (default .venv in the repository)
#   PYTHON=python  the interpreter to create it with (default python3)
# torch==2.13.0 is pinned here (not in the package): on these machines pip takes the CPU build already
# on disk. GPU machines: install the CUDA build of torch 2.13.0 into the environment first (README).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${MFT_VENV:-.venv}

# Optional Debian packages (CI runs as root on a fresh machine): install when apt and root are there.
apt_optional() {  # apt_optional PACKAGE "what is missing without it"
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" -eq 0 ]; then
        dpkg -s "$1" >/dev/null 2>&1 && return 0
        export DEBIAN_FRONTEND=noninteractive
        { apt-get install -y -qq "$1" || { apt-get update -qq && apt-get install -y -qq "$1"; }; } >/dev/null 2>&1 \
            || echo "note: could not install $1; $2"
    elif ! dpkg -s "$1" >/dev/null 2>&1; then
        echo "note: $1 is not installed and this is not root with apt; $2"
    fi
}
# ISA-L for the fast Reed-Solomon codec; without it rs uses the slower numpy bit-matrix code
apt_optional libisal2 "Reed-Solomon will use the slower numpy codec"
# etcd 3.4 for `health.store: etcd://HOST:PORT` and the tests that start a real etcd server
apt_optional etcd-server "health.store etcd:// tests will be skipped"
apt_optional openssl "the etcd-over-TLS test (its certificates) will be skipped"
# the multi-host test bed (megatron_ft/testing/hosts.py): ip, tc (iproute2), nsenter, unshare (util-linux)
apt_optional iproute2 "multi-host tests will be skipped (and fail under CI=true)"
apt_optional util-linux "multi-host tests will be skipped (and fail under CI=true)"
# a real Slurm on the test bed (megatron_ft/testing/slurm.py): munge, controller, node daemon, clients
for pkg in munge slurmctld slurmd slurm-client; do
    apt_optional "$pkg" "the Slurm tests will be skipped (and fail under CI=true)"
done

if [ ! -x "$VENV/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
scripts/check_venv.sh "$PY"
# deepspeed (optional extra) is pure Python here: DS_BUILD_OPS=0 skips its CUDA/C++ op builds
DS_BUILD_OPS=0 "$PY" -m pip install --disable-pip-version-check -q torch==2.13.0 -e ".[megatron,test,deepspeed,etcd,plot]"
"$PY" -c "import megatron_ft.capture.checksum as c; print('megatron-ft installed in $VENV; native copy+checksum:', c.HAVE_NATIVE)"
