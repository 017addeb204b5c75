#!/usr/bin/env bash
# Set up megatron-ft on a fresh machine and run the default test suite (< 15 min on 2 cores).
# Slow scenarios: python3 -m pytest -m slow
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q "$@"
