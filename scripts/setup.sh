#!/usr/bin/env bash
# Install megatron-ft and everything it needs on a fresh machine (CPU, Python 3.11).
# torch==2.13.0 is pinned: on these machines pip takes the CPU build already on disk.
# GPU machines: install the CUDA build of torch 2.13.0 first (README, "GPU machines").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --disable-pip-version-check -q -e ".[test]"
"$PY" -c "import megatron_ft.checksum as c; print('megatron-ft installed; native copy+checksum:', c.HAVE_NATIVE)"
