#!/usr/bin/env bash
# One device call that A/Bs source variants of the kernels (carry [".deps", ".whl"]):
#   OUT=$OUT bash tools/ab-call.sh VARIANTS_DIR_OR_LIST
# VARIANTS_DIR holds one folder per variant (see tools/ab-variants.sh: replaced files and/or a
# `cuda-flags` file with -D switches); "main" (created if missing) is the tree as is. Each variant
# is built, then benchmarked and tested by tools/ab-families.sh according to its name prefix
# (main: everything + the GPU suite; d*: dense; sd*: sparse decode; p*: prefill; mha*: dense MHA prefill). Writes, under
# $OUT (only a few files come back from the device): call.log (GPU, clocks, every variant's test
# tail), compare.txt (bench/compare.py of each variant's JSONs against main's) and json.tgz (all
# benchmark JSONs and C++ grid logs).
set -uo pipefail
cd "$(dirname "$0")/.."
V=${1:?variants folder or list file}
# A list file (bench/ab/NAME.txt, see bench/ab/README.md): one variant per line, "name -DMACRO=1 ... VAR=value
# ...", '#' comments; its folders (cuda-flags and env files, plus "main") are made under /tmp/ab-variants.
if [ -f "$V" ]; then
  list=$V; V=/tmp/ab-variants
  rm -rf "$V"; mkdir -p "$V/main"
  while read -r name rest; do
    { [ -z "$name" ] || [ "${name#\#}" != "$name" ]; } && continue
    mkdir -p "$V/$name"
    for tok in $rest; do
      case $tok in
        -D*) echo -n "$tok " >> "$V/$name/cuda-flags" ;;  # a build switch
        *=*) echo "$tok" >> "$V/$name/env" ;;            # an environment variable of the variant's runs
      esac
    done
  done < "$list"
fi
FINAL=${OUT:-/tmp/out}
mkdir -p "$FINAL"
export OUT=/tmp/ab-out AB_JSON=/tmp/j
rm -rf "$OUT" "$AB_JSON"; mkdir -p "$OUT" "$AB_JSON"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.limit --format=csv,noheader > "$FINAL/call.log" 2>&1
bash tools/ab-variants.sh "$V" bash tools/ab-families.sh >> "$FINAL/call.log" 2>&1
rc=$?
echo "ab rc $rc" >> "$FINAL/call.log"
for d in "$AB_JSON"/*/; do
  n=$(basename "$d"); [ "$n" = main ] && continue
  for j in "$d"*.json; do
    [ -f "$j" ] && [ -f "$AB_JSON/main/$(basename "$j")" ] || continue
    python3 bench/compare.py "$AB_JSON/main/$(basename "$j")" "$j"
    case $(basename "$j") in  # decode: also the whole call (scheduler + kernel + combine)
      *decode*) python3 bench/compare.py --key call_time_us "$AB_JSON/main/$(basename "$j")" "$j" ;;
      *dense-prefill*)  # dense MHA prefill: the forward and the backward call, each its own line per case
        python3 bench/compare.py --key ours_fwd_ms "$AB_JSON/main/$(basename "$j")" "$j"
        python3 bench/compare.py --key ours_bwd_ms "$AB_JSON/main/$(basename "$j")" "$j" ;;
    esac
  done
  # dense MHA prefill: the bits of out / lse / dq / dk / dv on fixed inputs (bench/dense_prefill_grad_hash.py)
  if [ -f "$d/grad-hash.txt" ] && [ -f "$AB_JSON/main/grad-hash.txt" ]; then
    if cmp -s "$AB_JSON/main/grad-hash.txt" "$d/grad-hash.txt"; then echo "--- $n: grad-hash identical to main's"
    else echo "--- $n: grad-hash DIFFERS from main's:"; diff "$AB_JSON/main/grad-hash.txt" "$d/grad-hash.txt"; fi
  fi
done > "$FINAL/compare.txt" 2>&1
tar -czf "$FINAL/json.tgz" -C "$AB_JSON" .
exit $rc
