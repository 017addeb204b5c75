#!/usr/bin/env bash
# Set up megatron-ft on a fresh machine (into ./.venv, see setup.sh) and run the CPU demo: train a tiny
# megatron-core GPT on 2 simulated nodes x 2 ranks, SIGKILL a trainer mid-run, recover from the agents'
# memory, and compare bit for bit with an uninterrupted run. Extra arguments go to `megatron-ft demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
VENV=$(cd "${MFT_VENV:-.venv}" && pwd)
export PATH="$VENV/bin:$PATH" VIRTUAL_ENV="$VENV"
exec "$VENV/bin/megatron-ft" demo "$@"
