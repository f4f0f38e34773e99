#!/usr/bin/env bash
# cross_head_norm on one GPU machine, in one run of at most BUDGET_S seconds (530 by default: a
# 16-core H100 host): build times from an empty cache, the GPU tests (and the op's nvcc checks),
# the tuned kernel against the former versions of 0c0c9f5 (old, new, new, old at every bench
# shape), the benchmark sweep, Nsight Compute's achieved occupancy of every rung, the docs' generated
# tables and notebook 02 executed. Each step logs to $OUT/<step>.log; a failing step does not stop
# the ones after it, a step that would overrun the budget is cut short (its log says so), and a
# summary table comes last (also $OUT/summary.txt). Results travel as $OUT/results.tgz.
#
#   OUT=/tmp/out COOKBOOK_COMMIT=<commit> bash tools/gpu_cross_head_norm.sh [OLD_KERNELS]
#   STEPS="bench ncu docs notebook" OUT=/tmp/out bash tools/gpu_cross_head_norm.sh   # some steps only
#
# OLD_KERNELS: the former kernels folder; by default build/old-0c0c9f5/kernels_cuda, made on a
# machine with the history by
#   mkdir -p build/old-0c0c9f5 && git archive 0c0c9f5 kernels_cuda | tar -x -C build/old-0c0c9f5
# (build/ is ignored by git: carry it to a GPU machine that gets the working tree without .git),
# else taken from git where this checkout has its history; the comparison is skipped without it.
# COOKBOOK_COMMIT names the commit in the pages where the tree has no .git. The builds go to
# build/cookbook-cross-head-norm, which a later call on the same machine reuses (STEPS without
# build_times).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
OLD_COMMIT=0c0c9f5
OLD_VERSIONS=6,12,13,14      # the former versions fastest at some bench shape (docs/results history)
NCU_SHAPE=5                  # BENCH_SHAPES[5]: 2048 tokens x 8192, q and k views of one qkv tensor
BUDGET_S=${BUDGET_S:-530}
STEPS=${STEPS:-"build_times tests compare bench ncu docs notebook"}
START=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export COOKBOOK_BUILD_DIR=${COOKBOOK_BUILD_DIR:-$PWD/build/cookbook-cross-head-norm}
export NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
declare -a ORDER=()
declare -A RESULT=() TOOK=()

wanted() { [[ " $STEPS " == *" $1 "* ]]; }
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

# step NAME LIMIT_S command...: run it, logged to $OUT/NAME.log, for at most LIMIT_S seconds (and
# never past the budget).
step() {
  local name=$1 limit=$2
  shift 2
  ORDER+=("$name")
  local remaining
  remaining=$(left)
  if (( remaining < 20 )); then
    RESULT[$name]="skipped: the budget is spent"; TOOK[$name]=0; return
  fi
  (( limit > remaining - 5 )) && limit=$(( remaining - 5 ))
  local t0
  t0=$(date +%s)
  echo "== $name (at most ${limit} s) ==" | tee -a "$OUT/progress.log"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  TOOK[$name]=$(( $(date +%s) - t0 ))
  case $rc in
    0) RESULT[$name]="ok" ;;
    124|137) RESULT[$name]="cut short after ${limit} s" ; echo "!! cut short after ${limit} s" >> "$OUT/$name.log" ;;
    *) RESULT[$name]="failed (exit $rc)" ;;
  esac
  echo "   ${RESULT[$name]} in ${TOOK[$name]} s" | tee -a "$OUT/progress.log"
}

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  nproc
  python3 -c "import torch, numba; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__)"
  nvcc --version | tail -1
  git log -1 --format='commit %h %s' 2>/dev/null || echo "no git history here"
} > "$OUT/env.txt" 2>&1

# The former kernels, for the comparison.
OLD=${1:-}
[[ -z $OLD && -f build/old-$OLD_COMMIT/kernels_cuda/bindings/cross_head_norm.cu ]] && OLD=$PWD/build/old-$OLD_COMMIT/kernels_cuda
if [[ -z $OLD ]] && git rev-parse --verify -q "$OLD_COMMIT^{commit}" > /dev/null 2>&1; then
  mkdir -p /tmp/old-kernels-$OLD_COMMIT
  git archive "$OLD_COMMIT" kernels_cuda | tar -x -C /tmp/old-kernels-$OLD_COMMIT && OLD=/tmp/old-kernels-$OLD_COMMIT/kernels_cuda
fi
[[ -n $OLD && ! -f $OLD/bindings/cross_head_norm.cu ]] && { echo "no bindings/cross_head_norm.cu in $OLD" >> "$OUT/env.txt"; OLD=""; }
echo "old kernels: ${OLD:-none}" >> "$OUT/env.txt"

# 1. Build times from an empty cache (nothing else running), the whole op kept for the steps below.
if wanted build_times; then
  rm -rf "$COOKBOOK_BUILD_DIR"
  step build_times 150 python3 tools/build_times.py cross_head_norm --cache "$COOKBOOK_BUILD_DIR"
fi

# 2. The GPU tests; beside them, on the CPU, the op's nvcc checks and the former kernels' build.
if wanted tests || wanted compare; then
  if [[ -n $OLD ]]; then
    python3 - "$OLD" "$OLD_COMMIT" "$OLD_VERSIONS" > "$OUT/old_build.log" 2>&1 <<'PY' &
import sys
from pathlib import Path
sys.path.insert(0, "tools")
import compare_tuned
compare_tuned.old_candidates("cross_head_norm", Path(sys.argv[1]).resolve(), sys.argv[2], [int(v) for v in sys.argv[3].split(",")])
print("built")
PY
    OLD_BUILD=$!
  fi
fi
if wanted tests; then
  timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_sources.py -k cross_head \
    > "$OUT/cuda_sources.log" 2>&1 &
  SOURCES=$!
  step tests 200 python3 -m pytest -q -p no:cacheprovider -W ignore::numba.core.errors.NumbaPerformanceWarning \
    --junitxml="$OUT/tests.xml" tests/test_gpu_cross_head_norm.py
  ORDER+=(cuda_sources)
  t0=$(date +%s)
  if wait "$SOURCES"; then RESULT[cuda_sources]="ok"; else RESULT[cuda_sources]="failed"; fi
  TOOK[cuda_sources]=$(( $(date +%s) - t0 ))" (waited)"
fi

# 3. Old against new: the tuned kernel and the fastest of the former versions at every bench shape.
if wanted compare; then
  if [[ -n $OLD ]]; then
    [[ -n ${OLD_BUILD:-} ]] && wait "$OLD_BUILD"
    step compare 150 python3 tools/compare_tuned.py --op cross_head_norm --old-kernels "$OLD" \
      --old-commit "$OLD_COMMIT" --old-version "$OLD_VERSIONS"
  else
    ORDER+=(compare); RESULT[compare]="skipped: no former kernels (pass the folder as the first argument)"; TOOK[compare]=0
  fi
fi

# 4. The benchmark sweep: every implementation at every bench shape (the Numba kernels aside).
wanted bench && step bench 200 python3 -m cookbook bench --ops cross_head_norm --impls reference cuda tuned peer \
  --out "$OUT/bench" --results-dir docs/results

# 5. Achieved occupancy of every rung and the tuned kernel (one call each, under Nsight Compute).
if wanted ncu; then
  if command -v ncu > /dev/null; then
    step ncu 130 python3 -m cookbook.ncu --op cross_head_norm --shape "$NCU_SHAPE" --tag ladder --out "$OUT/ncu" \
      --results-dir docs/results --impls cuda_v1 cuda_v2 cuda_v3 cuda_v4 cuda_v5 cuda_v6 cuda_v7 cuda_tuned
  else
    ORDER+=(ncu); RESULT[ncu]="skipped: ncu not on PATH"; TOOK[ncu]=0
  fi
fi

# 6. The page's generated tables, from the pages just written.
wanted docs && step docs 90 python3 tools/docs_versions.py --write cross_head_norm

# 7. Notebook 02, executed on this GPU.
wanted notebook && step notebook 170 python3 tools/run_notebook.py notebooks/02_cross_head_norm.py

tar czf "$OUT/results.tgz" docs/results/cross_head_norm_* docs/cross_head_norm.md notebooks/02_cross_head_norm.ipynb \
  2> /dev/null

{
  echo "cross_head_norm on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1): $(( $(date +%s) - START )) s"
  printf '%-14s %-10s %s\n' step seconds result
  for name in "${ORDER[@]}"; do
    printf '%-14s %-10s %s\n' "$name" "${TOOK[$name]:-0}" "${RESULT[$name]:-?}"
  done
  echo
  echo "tests: $(tail -1 "$OUT/tests.log" 2>/dev/null)"
  echo "nvcc checks: $(tail -1 "$OUT/cuda_sources.log" 2>/dev/null)"
  grep -h "^| " "$OUT/compare.log" 2>/dev/null | head -16
  tail -4 "$OUT/build_times.log" 2>/dev/null
} | tee "$OUT/summary.txt"
