#!/usr/bin/env bash
# Apply megatron-ft's Megatron-LM patch series to a Megatron-LM checkout.
#
#   scripts/apply_megatron_patches.sh MEGATRON_LM_DIR [TAG]
#
# TAG names the series directory patches/megatron-lm/TAG/ (one per supported release). Without TAG
# the script picks the series that applies to the tree as a whole (newest release first), or names
# the supported releases and refuses. Every patch is first checked with `git apply --check`; if one
# does not apply, nothing is changed and the script names the patch and shows git's report (file and
# hunk). Then the series is applied with `git am --3way` (commits authored as in the patches) when
# MEGATRON_LM_DIR is a git work tree with a clean index, else with `git apply` (working tree only).
# Exit status: 0 applied, 1 no series (or the named one) applies, 2 bad usage.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SERIES_ROOT="$HERE/patches/megatron-lm"
SUPPORTED="$(ls "$SERIES_ROOT" | sort -r | paste -sd' ')"
usage() { echo "usage: $0 MEGATRON_LM_DIR [TAG]   (TAG: one of: $SUPPORTED)" >&2; exit 2; }
[ $# -ge 1 ] && [ $# -le 2 ] || usage
MLM="$1"
[ -f "$MLM/megatron/training/arguments.py" ] || {
  echo "error: MEGATRON_LM_DIR=$MLM is not a Megatron-LM checkout (no megatron/training/arguments.py)" >&2; exit 2; }
cd "$MLM"
is_git=0
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then is_git=1; fi

# check_series TAG: every patch of the series applies on top of the previous ones, without touching
# the tree; on failure CHECK_REPORT names the patch and holds git's report
check_series() {
  local dir="$SERIES_ROOT/$1" p out
  mapfile -t PATCHES < <(grep -v '^\s*\(#\|$\)' "$dir/series")
  CHECK_REPORT=""
  if [ $is_git = 1 ]; then
    # a temporary index: patch N is checked against the tree patched by 1..N-1
    local tmp_index; tmp_index="$(mktemp)"
    GIT_INDEX_FILE="$tmp_index" git read-tree HEAD
    for p in "${PATCHES[@]}"; do
      if ! out=$(GIT_INDEX_FILE="$tmp_index" git apply --cached --check "$dir/$p" 2>&1); then
        CHECK_REPORT="patch $p does not apply:"$'\n'"$out"; rm -f "$tmp_index"; return 1
      fi
      GIT_INDEX_FILE="$tmp_index" git apply --cached "$dir/$p"
    done
    rm -f "$tmp_index"
  else
    # not a git tree: each patch is checked against the tree as is (two patches of one file touch
    # different places of it, so the later one still applies, at an offset)
    for p in "${PATCHES[@]}"; do
      if ! out=$(git apply --check "$dir/$p" 2>&1); then
        CHECK_REPORT="patch $p does not apply:"$'\n'"$out"; return 1
      fi
    done
  fi
}

# 1. the series: the one named, else the first (newest release) that applies as a whole
if [ $# -eq 2 ]; then
  TAG="$2"
  [ -d "$SERIES_ROOT/$TAG" ] || { echo "error: no patch series for TAG=$TAG in $SERIES_ROOT" >&2; usage; }
  check_series "$TAG" || {
    echo "error: the $TAG series does not apply to $MLM (is it Megatron-LM $TAG?): $CHECK_REPORT" >&2
    echo "nothing was changed" >&2; exit 1; }
else
  TAG=""; reports=""
  for t in $SUPPORTED; do
    if check_series "$t"; then TAG="$t"; break; fi
    reports+=$'\n'"  $t: ${CHECK_REPORT//$'\n'/$'\n'    }"
  done
  [ -n "$TAG" ] || {
    echo "error: $MLM is none of the Megatron-LM releases megatron-ft supports ($SUPPORTED); per series:$reports" >&2
    echo "nothing was changed (docs/megatron-lm.md says how to port the series to another release)" >&2; exit 1; }
  echo "the $TAG series applies to $MLM"
fi
SERIES_DIR="$SERIES_ROOT/$TAG"
mapfile -t PATCHES < <(grep -v '^\s*\(#\|$\)' "$SERIES_DIR/series")

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
