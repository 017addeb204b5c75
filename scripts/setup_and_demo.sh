#!/usr/bin/env bash
# Set up megatron-ft on a fresh machine and run the CPU demo: train a tiny megatron-core GPT on
# 2 simulated nodes x 2 ranks, SIGKILL a trainer mid-run, recover from the agents' memory, and
# compare bit for bit with an uninterrupted run. Extra arguments go to `megatron-ft demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec megatron-ft demo "$@"
