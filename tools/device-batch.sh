#!/usr/bin/env bash
# One device call as a list of steps under one deadline, whose results always come back.
#
# The device returns only what is under $OUT when the command ends, at most a few files, and a call that runs past its
# limit returns nothing that was not written there yet. This runner gives every step its own time limit, cuts each
# one to what is left of the call's deadline, skips the steps that no longer fit, and packs everything under $R into
# ONE archive, $OUT/batch.tgz, on every exit (also when a step hangs and is killed). Steps run one after another, so a
# timing step never shares the GPU with another step; a step may start background work of its own (a build) and the
# runner waits for nothing it did not start.
#
# Usage (GPU machine, repository root):
#   DEADLINE_S=540 bash tools/device-batch.sh 'NAME|LIMIT_S|COMMAND' ...
# Each step's stdout and stderr go to $R/NAME.log (R=/tmp/batch, exported to the steps: write extra files there) and
# its exit status and seconds to $R/steps.txt; the call's log (GPU name and clocks, each step's last lines) to
# $R/batch.log, also printed. A step whose NAME starts with '?' runs only if every step before it succeeded.
# A step that would get less than MIN_STEP_S seconds (default 15) is skipped.
# Example:
#   DEADLINE_S=520 bash tools/device-batch.sh \
#     'ab|240|bash tools/dense-prefill-ab.sh --old build-ab/old --fwd "2:default default" --bwd ""' \
#     '?pytest|90|python3 -m pytest -q tests/gpu/test_dense_prefill_gpu.py'
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
export R=${R:-/tmp/batch}
DEADLINE_S=${DEADLINE_S:-540}
T0=$(date +%s)
rm -rf "$R"; mkdir -p "$R" "$OUT"
pack() { (cd "$(dirname "$R")" && tar czf "$OUT/batch.tgz" "$(basename "$R")"); }
trap pack EXIT
log() { echo "$*" | tee -a "$R/batch.log"; }
log "$(nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader 2>&1 | head -1)"
all_ok=1
for spec in "$@"; do
  name=${spec%%|*}; rest=${spec#*|}; limit=${rest%%|*}; cmd=${rest#*|}
  only_if_ok=0
  if [ "${name#\?}" != "$name" ]; then only_if_ok=1; name=${name#\?}; fi
  left=$((DEADLINE_S - ($(date +%s) - T0)))
  if [ "$only_if_ok" = 1 ] && [ "$all_ok" = 0 ]; then log "=== $name: skipped (an earlier step failed)"; continue; fi
  if [ "$left" -lt "${MIN_STEP_S:-15}" ]; then log "=== $name: skipped (${left} s left)"; continue; fi
  [ "$limit" -gt "$left" ] && limit=$left
  log "=== $name (limit ${limit} s, at $(( $(date +%s) - T0 )) s)"
  s0=$(date +%s)
  timeout --kill-after=5 "$limit" bash -c "$cmd" > "$R/$name.log" 2>&1
  rc=$?
  note=""; [ "$rc" = 124 ] && note=" (timed out)"
  echo "$name rc=$rc$note $(( $(date +%s) - s0 )) s" >> "$R/steps.txt"
  [ "$rc" = 0 ] || all_ok=0
  tail -n "${TAIL_LINES:-25}" "$R/$name.log" | tee -a "$R/batch.log"
  log "--- $name rc=$rc"
done
log "=== done at $(( $(date +%s) - T0 )) s"
