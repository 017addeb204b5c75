#!/usr/bin/env bash
# Set up megatron-ft on a fresh machine (into ./.venv, see setup.sh) and run the default test suite
# (< 15 min on 2 cores). Slow scenarios: .venv/bin/python -m pytest -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV=$(cd "${MFT_VENV:-.venv}" && pwd)
export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV"  # tests start megatron-ft, torchrun, python3 from it
exec "$VENV/bin/python" -m pytest -q "$@"
