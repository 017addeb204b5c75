#!/usr/bin/env bash
# Apply megatron-ft's Megatron-LM patch series to a Megatron-LM checkout.
#
#   scripts/apply_megatron_patches.sh MEGATRON_LM_DIR [TAG]
#
# TAG (default core_v0.16.1) names the series directory patches/megatron-lm/TAG/. Every patch is
# first checked with `git apply --check`; if one does not apply, nothing is changed and the script
# names the patch and shows git's report (file and hunk). Then the series is applied with
# `git am --3way` (commits authored as in the patches) when MEGATRON_LM_DIR is a git work tree
# with a clean index, else with `git apply --3way` / `git apply` (working tree only).
# Exit status: 0 applied, 1 a patch does not apply, 2 bad usage.
set -euo pipefail

usage() { echo "usage: $0 MEGATRON_LM_DIR [TAG]   (TAG: one of: $(ls "$SERIES_ROOT" | tr '\n' ' '))" >&2; exit 2; }
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SERIES_ROOT="$HERE/patches/megatron-lm"
[ $# -ge 1 ] && [ $# -le 2 ] || usage
MLM="$1"
TAG="${2:-core_v0.16.1}"
SERIES_DIR="$SERIES_ROOT/$TAG"
[ -d "$SERIES_DIR" ] || { echo "error: no patch series for TAG=$TAG in $SERIES_ROOT" >&2; usage; }
[ -f "$MLM/megatron/training/arguments.py" ] || {
  echo "error: MEGATRON_LM_DIR=$MLM is not a Megatron-LM checkout (no megatron/training/arguments.py)" >&2; exit 2; }

mapfile -t PATCHES < <(grep -v '^\s*\(#\|$\)' "$SERIES_DIR/series")
cd "$MLM"
is_git=0
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then is_git=1; fi

# 1. check every patch on top of the previous ones, without touching the tree
if [ $is_git = 1 ]; then
  # check in a temporary index so that patch N is checked against the tree patched by 1..N-1
  tmp_index="$(mktemp)"; trap 'rm -f "$tmp_index"' EXIT
  GIT_INDEX_FILE="$tmp_index" git read-tree HEAD
  for p in "${PATCHES[@]}"; do
    if ! out=$(GIT_INDEX_FILE="$tmp_index" git apply --cached --check "$SERIES_DIR/$p" 2>&1); then
      echo "error: patch $p does not apply to $MLM (is it Megatron-LM $TAG?):" >&2
      echo "$out" >&2
      echo "nothing was changed" >&2
      exit 1
    fi
    GIT_INDEX_FILE="$tmp_index" git apply --cached "$SERIES_DIR/$p"
  done
else
  # not a git tree: each patch is checked against the tree as is (two patches of one file touch
  # different places of it, so the later one still applies, at an offset)
  for p in "${PATCHES[@]}"; do
    if ! out=$(git apply --check "$SERIES_DIR/$p" 2>&1); then
      echo "error: patch $p does not apply to $MLM (is it Megatron-LM $TAG?):" >&2
      echo "$out" >&2; echo "nothing was changed" >&2; exit 1
    fi
  done
fi

# 2. apply
for p in "${PATCHES[@]}"; do
  if [ $is_git = 1 ] && git diff --cached --quiet; then
    git am --3way --keep-cr "$SERIES_DIR/$p" >/dev/null || {
      echo "error: git am failed on $p; run 'git am --abort' in $MLM" >&2; exit 1; }
  else
    git apply "$SERIES_DIR/$p" || { echo "error: patch $p failed (earlier patches are applied)" >&2; exit 1; }
  fi
  echo "applied $p"
done
echo "megatron-ft patch series $TAG applied to $MLM"
