#!/usr/bin/env bash
# Where the host time of an eager decode call goes (issue 25, item 4), on the GPU machine, in < 120 s.
# Run after `bash tools/device-run.sh build` (our package installed, /tmp/site holding TVM-FFI); FlashMLA
# side by side when it was built into /tmp/anchor/flashmla (bash .anchor/build.sh; skipped otherwise).
# Every step is optional: one that fails or runs out of its time is logged and the next one runs.
# Writes under $OUT (default /tmp/out):
#   env.txt                    GPU clocks / pstate before and after, CPU model, versions
#   core.txt, core.json        tools/host_path_core.cu: the C++ core alone (cudaMalloc'd buffers): plan, each
#                              launch stage, whole fwd, tensor-map encode, CUDA runtime call floors
#   layers-ours.txt/.json      tools/host_path_layers.py layers: public API, Python layer alone (op stubbed),
#                              _torch_ops wrapper, OpOverload, packet, TVM-FFI, torch allocation baselines
#   layers-flashmla.txt/.json  the same ways in of FlashMLA (api, Python layer alone, pybind11 direct)
#   pyspy-*.raw, pyspy-*.txt   py-spy --native samples of a loop of public-API calls (b1 h16 s_k64), summarised
#   perf-ours.txt              perf report of the same loop, when perf is installed
#   summary.txt                the lines above that matter, one file
# Usage: bash tools/profile-host-path.sh    (env: OUT, ANCHOR_DIR=/tmp/anchor/flashmla, PYSPY_WHEEL=<py-spy wheel>;
#        the wheel is also looked for in .anchor/tools/, .whl/ and /tmp; PROFILE_BUDGET_S (default 112);
#        PROFILE_SKIP_CORE=1 leaves out the C++-core-alone step; PROFILE_EAGER_ROUTE=1 measures our package with the
#        eager TVM-FFI route of torch decode calls switched on: host_path_layers.py --eager-route)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
ANCHOR_DIR=${ANCHOR_DIR:-/tmp/anchor/flashmla}
DEVICE=${PROFILE_DEVICE:-cuda}  # (cpu: a dry run of the loops on the reference backend, on a machine without a GPU)
BUDGET=${PROFILE_BUDGET_S:-112}
EAGER=(); [ "${PROFILE_EAGER_ROUTE:-0}" != 0 ] && EAGER=(--eager-route)  # (ours only: FlashMLA has no such route)
T0=$SECONDS
left() { echo $((BUDGET - (SECONDS - T0))); }
# step NAME LIMIT_S CMD...: runs CMD with a time limit of min(LIMIT_S, what is left - 2); logs its status.
step() {
  local name=$1 limit=$2; shift 2
  local l; l=$(left); l=$((l - 2)); [ "$limit" -lt "$l" ] && l=$limit
  if [ "$l" -lt 3 ]; then echo "=== $name: SKIPPED (time budget spent)"; return 1; fi
  echo "=== $name ($(date +%T), limit ${l} s, $((SECONDS - T0)) s used)"
  timeout -k 3 "$l" "$@"; local rc=$?
  [ $rc -ne 0 ] && echo "=== $name: rc $rc$([ $rc -eq 124 ] && echo ' (timed out)')"
  return $rc
}

# ---- environment
{
  date -u; nproc; (lscpu 2>/dev/null | grep -E "Model name|MHz|NUMA node\(s\)") || true
  nvidia-smi --query-gpu=name,pstate,clocks.sm,clocks.mem,clocks.max.sm,power.draw,temperature.gpu --format=csv 2>&1
  python3 -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, torch.version.cuda)" 2>&1
  python3 -c "import flash_mla, flash_mla._torch_ops as t; print('flash_mla', flash_mla.__file__, 'torch.ops', t.available(), t.library_path())" 2>&1
  command -v nvcc || ls /usr/local/cuda/bin/nvcc
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# ---- the C++ core alone
PKG=$(python3 -c "import flash_mla, os; print(os.path.dirname(flash_mla.__file__))" 2>/dev/null)
CORE_LIB=""
for f in "$PKG/lib/libflashmla_core.a" build/device/libflashmla_core.a; do [ -f "$f" ] && { CORE_LIB=$f; break; }; done
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [ "${PROFILE_SKIP_CORE:-0}" != 0 ]; then
  echo "=== host_path_core: SKIPPED (PROFILE_SKIP_CORE)"
elif [ -n "$CORE_LIB" ] && [ -x "$NVCC" ]; then
  step "build tools/host_path_core.cu against $CORE_LIB" 45 \
    "$NVCC" -O2 -std=c++20 -gencode arch=compute_90a,code=sm_90a -I"$PKG/include" -Iinclude -Isrc tools/host_path_core.cu "$CORE_LIB" \
    -lpthread -ldl -o /tmp/host_path_core > "$OUT/core-build.log" 2>&1 || tail -20 "$OUT/core-build.log"
  if [ -x /tmp/host_path_core ]; then
    step "host_path_core" 20 /tmp/host_path_core 200 9 > "$OUT/core.txt" 2>&1
    cat "$OUT/core.txt" | grep -v '^JSON'
    grep '^JSON ' "$OUT/core.txt" | sed 's/^JSON //' > "$OUT/core.json"
  fi
else
  echo "=== host_path_core: SKIPPED (no libflashmla_core.a under $PKG/lib or build/device, or no nvcc)"
fi

# ---- the Python / torch layers, ours and FlashMLA's
step "layers (ours)" 40 python3 tools/host_path_layers.py layers --device "$DEVICE" ${EAGER[@]+"${EAGER[@]}"} \
  --json "$OUT/layers-ours.json" \
  > "$OUT/layers-ours.txt" 2>&1; cat "$OUT/layers-ours.txt"
HAVE_ANCHOR=0
if ls "$ANCHOR_DIR"/flash_mla/cuda*.so >/dev/null 2>&1; then
  HAVE_ANCHOR=1
  PYTHONPATH=$ANCHOR_DIR${PYTHONPATH:+:$PYTHONPATH} step "layers (FlashMLA from $ANCHOR_DIR)" 25 \
    python3 tools/host_path_layers.py anchor-layers --json "$OUT/layers-flashmla.json" > "$OUT/layers-flashmla.txt" 2>&1
  cat "$OUT/layers-flashmla.txt"
else
  echo "=== layers (FlashMLA): SKIPPED (no $ANCHOR_DIR/flash_mla/cuda*.so; bash .anchor/build.sh builds it)"
fi

# ---- py-spy native profile of a loop of public-API calls
PYSPY=""
for c in /tmp/pyspy/bin/py-spy /tmp/site/bin/py-spy "$(command -v py-spy 2>/dev/null)"; do
  [ -n "$c" ] && [ -x "$c" ] && { PYSPY=$c; break; }
done
if [ -z "$PYSPY" ]; then
  WHL=${PYSPY_WHEEL:-$(ls .anchor/tools/py_spy-*.whl .anchor/py_spy-*.whl .whl/py_spy-*.whl /tmp/py_spy-*.whl 2>/dev/null | head -1)}
  if [ -n "$WHL" ] && [ -f "$WHL" ]; then
    if python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy "$WHL" > "$OUT/pyspy-install.log" 2>&1; then
      PYSPY=/tmp/pyspy/bin/py-spy
    else
      echo "py-spy install failed: $(tail -2 "$OUT/pyspy-install.log")"
    fi
  else
    echo "=== py-spy: no py-spy and no wheel (PYSPY_WHEEL, .anchor/tools/, .whl/ or /tmp/py_spy-*.whl): skipped"
  fi
fi
pyspy_run() {  # pyspy_run LABEL [PYTHONPATH prefix (FlashMLA's)]
  local label=$1 pp=${2:-}
  local opt=(); [ -z "$pp" ] && opt=(${EAGER[@]+"${EAGER[@]}"})
  # py-spy attaches to the loop process after its imports and warm-up (host_path_layers.py loop --pyspy),
  # so that only the calls are sampled; SIGINT at the limit still writes what was sampled.
  PYTHONPATH=${pp:+$pp:}${PYTHONPATH:-} step "py-spy record --native ($label)" 25 \
    python3 tools/host_path_layers.py loop --seconds 4 --device "$DEVICE" ${opt[@]+"${opt[@]}"} --pyspy "$PYSPY" \
    --raw "$OUT/pyspy-$label.raw" > "$OUT/pyspy-$label.log" 2>&1
  local rc=$?
  if [ ! -s "$OUT/pyspy-$label.raw" ]; then
    echo "py-spy ($label) wrote nothing (rc $rc; ptrace may be refused in this container): $(tail -4 "$OUT/pyspy-$label.log")"
    return 1
  fi
  grep "^loop" "$OUT/pyspy-$label.log"
  python3 tools/host_path_layers.py pyspy-summary "$OUT/pyspy-$label.raw" --top 45 > "$OUT/pyspy-$label.txt" 2>&1
  head -75 "$OUT/pyspy-$label.txt"
}
if [ -n "$PYSPY" ] && [ -x "$PYSPY" ]; then
  pyspy_run ours
  [ $HAVE_ANCHOR = 1 ] && pyspy_run flashmla "$ANCHOR_DIR"
fi

# ---- perf (when installed and time is left)
if command -v perf >/dev/null 2>&1 && [ "$(left)" -gt 25 ]; then
  step "perf record (ours)" 20 python3 tools/host_path_layers.py loop --seconds 4 --device "$DEVICE" ${EAGER[@]+"${EAGER[@]}"} \
    --perf-data /tmp/perf-ours.data > "$OUT/perf-record.log" 2>&1 &&
    { echo "## self"; timeout 10 perf report -i /tmp/perf-ours.data --stdio --no-children -g none --sort dso,sym \
        --percent-limit 0.3 2>/dev/null | grep -v '^$' | cut -c1-220 | head -120
      echo "## inclusive"; timeout 10 perf report -i /tmp/perf-ours.data --stdio --children -g none --sort sym \
        --percent-limit 2 2>/dev/null | grep -v '^$' | cut -c1-220 | head -120
      echo "## self by shared object"; timeout 10 perf report -i /tmp/perf-ours.data --stdio --no-children -g none \
        --sort dso 2>/dev/null | grep -v '^$' | head -40; } > "$OUT/perf-ours.txt"
    head -50 "$OUT/perf-ours.txt"
else
  echo "=== perf: not installed or no time left"
fi

# ---- summary
{
  echo "# host path profile $(date -u +%FT%TZ), $((SECONDS - T0)) s"
  grep -E "pstate|^NVIDIA|^name" "$OUT/env.txt"
  echo "## C++ core alone (host us/call, synchronised us/call)"; grep -v '^JSON' "$OUT/core.txt" 2>/dev/null
  echo "## ours, by layer"; grep -E "us/call|skipped" "$OUT/layers-ours.txt" 2>/dev/null
  echo "## FlashMLA, by layer"; grep -E "us/call|skipped" "$OUT/layers-flashmla.txt" 2>/dev/null
  for f in "$OUT"/pyspy-*.txt; do [ -f "$f" ] && { echo "## $(basename "$f")"; head -50 "$f"; }; done
} > "$OUT/summary.txt" 2>&1
echo "=== done in $((SECONDS - T0)) s: $OUT/summary.txt"
nvidia-smi --query-gpu=pstate,clocks.sm,clocks.mem --format=csv,noheader >> "$OUT/env.txt" 2>&1
exit 0
