#!/usr/bin/env bash
# The GPU machine's checks, in one run (docs/benchmarks.md "GPU snapshot path"; docs/gpu.md):
#   1. benchmarks/gpu_snapshot.py: stall / clean (checksums summed on the host and on the device) / restore
#      against raw pinned copies, 1 and 16 GiB per rank, the slots on a huge-page tmpfs (SHM_DIR, mounted
#      here when root: the agent creates them faster there), restores in-process and as a fresh process
#      (page-locking while copying and through pinned blocks, alternating);
#   2. pytest tests/gpu and the checksum kernel's tests: the GPU snapshot path bit-exact, CUDA RNG included;
#      the compiled kernel against the host's sums; device and host sums writing the same digests; a
#      restore in the process reading its page-locked slot; the restore ordering (a zero-fill queued on
#      the training stream behind a long kernel lands before the restored bytes); the value guard, queued
#      behind the restore's copies, judging the restored bytes (a NaN version refused, rolled back); the
#      later capture (Megatron-LM's path: encoded and registered on the worker) copying what the training
#      stream queued before the hand-over, not after; a fresh process's restore, page-locking the slot
#      range by range while copying and through pinned blocks, bit-exact both ways;
#   3. megatron-ft demo --config configs/gpu/1x1.yaml --fail trainer: megatron-core's GPT on the GPU,
#      a trainer SIGKILLed, resumed from the agent's memory, bit-exact with deterministic algorithms;
#   4. benchmarks/scheduling.py at PP=4 on the machine's cores (CPU, CUDA hidden): only when asked (STEPS),
#      so that the default run fits one device command of 10 minutes (1-3: at most 470 s of time limits).
# For a machine with no package registry (Python 3.12, a CUDA torch): the wheels the project needs
# beside torch are in .whl/ (see docs/gpu.md), installed into /tmp/site without their pins.
# Every step has its own time limit; the figures and logs go to $OUT (default /tmp/gpu-checks).
# STEPS (default "1 2 3") picks the steps to run.
set -u
STEPS=${STEPS:-1 2 3}
want() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
OUT=${OUT:-/tmp/gpu-checks}
mkdir -p "$OUT"
exec > >(tee "$OUT/run.log") 2>&1
step() { echo; echo "=== $(date -u +%H:%M:%S) $*"; }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 2; }
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
step machine
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, numpy, megatron.core as mc; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__, 'megatron-core', mc.__version__)"
python3 -c "from megatron_ft.capture import checksum; print('native checksum:', checksum.HAVE_NATIVE)"
nproc; free -g | head -2
shm_gib=$(df -B1G --output=size /dev/shm | tail -1 | tr -d ' ')
echo "/dev/shm: ${shm_gib} GiB"
if [ "${shm_gib:-0}" -lt 48 ]; then mount -o remount,size=96G /dev/shm && df -h /dev/shm; fi

if want 1; then step "1. GPU snapshot benchmark"
SHM_DIR=${SHM_DIR:-/mnt/mft-huge}
mounted=""
if [ ! -d "$SHM_DIR" ] || ! python3 -m megatron_ft.cli shm-mount "$SHM_DIR" --check >/dev/null 2>&1; then
  if python3 -m megatron_ft.cli shm-mount "$SHM_DIR" --size 72G; then mounted=$SHM_DIR; else SHM_DIR=/dev/shm; fi
fi
timeout 200 python3 benchmarks/gpu_snapshot.py --sizes-gib ${GPU_SIZES:-1,16} --shm-dir "$SHM_DIR" \
  --json "$OUT/gpu_snapshot.json"
echo "rc=$?"
if [ -n "$mounted" ]; then umount "$mounted" && rmdir "$mounted"; fi; fi

if want 2; then step "2. GPU tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_lanes_kernel.py 2>&1 | tail -15
echo "rc=${PIPESTATUS[0]}"; fi

if want 3; then step "3. trainer kill on the GPU, resumed from memory"
timeout 150 python3 -m megatron_ft.cli demo --config configs/gpu/1x1.yaml --fail trainer --iters 10 --kill-at 5 \
  --workdir /tmp/gpu-demo > "$OUT/demo.txt" 2>&1
echo "rc=$?"; tail -14 "$OUT/demo.txt"
grep -q '"bitwise_identical": true' "$OUT/demo.txt" || { tail -80 /tmp/gpu-demo/run.log > "$OUT/demo-run-tail.txt";
  tail -60 /tmp/gpu-demo/reference.log > "$OUT/demo-reference-tail.txt"; } 2>/dev/null; fi

if want 4; then step "4. scheduling at PP=4, CPU"
CUDA_VISIBLE_DEVICES= timeout 200 python3 benchmarks/scheduling.py --pp 4 --modes off,local,blocking,pipelined \
  --segment 4 --cycles 5 --profile 5 --amortize 0 --idle device --no-docs --workdir /tmp/gpu-sched > "$OUT/scheduling.txt" 2>&1
echo "rc=$?"; tail -25 "$OUT/scheduling.txt"; fi
step done
ls /dev/shm | grep -c '^mft\.' || true
