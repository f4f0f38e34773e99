#!/usr/bin/env bash
# qk_norm_rope on one GPU machine (an H100 or H200 with 16 cores): build, test, old against new,
# benchmark, build times, notebook; each stage within its own time limit and all within BUDGET_S, so
# that one call ends inside a caller's limit (a stage that no longer fits is skipped and named in the
# summary: call again with those stages on the same warm machine, whose build cache is kept).
#
#   bash tools/gpu_qk_norm_rope.sh OLD_KERNELS [stages]
#     OLD_KERNELS  the kernels_cuda/ folder of the commit the tuned kernel is compared against, e.g.
#                  git archive 0c0c9f5 kernels_cuda | tar -x -C shared/old   ->   shared/old/kernels_cuda
#                  (OLD_COMMIT names it, default 0c0c9f5; OLD_VERSION its fastest version, default 9)
#     stages       comma-separated, run in this order (default: all of them):
#       build        every qk_norm_rope extension (the seven rungs and the tuned kernel) in parallel,
#                    and, in the background, the old commit's header as its own extension
#       tests        tests/test_gpu_qk_norm_rope.py but its sanitizer test (every rung and the tuned
#                    kernel, the policy's edges, graphs, compile, opcheck)
#       sanitizer    its compute-sanitizer memcheck test
#       integrations tests/test_integrations.py (the patched Qwen3 and FLUX forwards on the GPU)
#       compare      tools/compare_tuned.py: old v9 against the tuned kernel at every bench shape,
#                    old, new, new, old -> docs/results/qk_norm_rope_<gpu>_tuned_vs_<commit>.{md,json}
#       bench        the benchmark of qk_norm_rope, --results-dir docs/results (rungs, tuned, reference, peers; no
#                    Numba) -> docs/results/qk_norm_rope_<gpu>.{md,json,png}
#       builds       tools/build_times.py qk_norm_rope: first auto call and the whole op from empty
#                    caches -> docs/results/qk_norm_rope_<gpu>_builds.{md,json}
#       notebook     tools/run_notebook.py notebooks/04_qk_norm_rope.py (writes the .ipynb)
#
# What comes back in $OUT: summary.txt (each stage's status and seconds, and what was skipped),
# env.txt, one log per stage (logs/), and results.tgz: the pages written under docs/results/ and the
# executed notebook. A failing stage does not stop the later ones.
set -uo pipefail
OLD_KERNELS=${1:?usage: bash tools/gpu_qk_norm_rope.sh OLD_KERNELS [stages]}
stages=${2:-build,tests,sanitizer,integrations,compare,bench,builds,notebook}
OLD_COMMIT=${OLD_COMMIT:-0c0c9f5}; OLD_VERSION=${OLD_VERSION:-9}
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs; mkdir -p "$OUT" "$LOGS"
BUDGET_S=${BUDGET_S:-520}
export PYTHONUNBUFFERED=1 COOKBOOK_BUILD_DIR=${COOKBOOK_BUILD_DIR:-$PWD/build/cookbook}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
start=$SECONDS
touch "$OUT/.start"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1
  echo "cores: $(nproc); old kernels: $OLD_KERNELS ($OLD_COMMIT, v$OLD_VERSION); stages: $stages; budget ${BUDGET_S} s"
} > "$OUT/env.txt" 2>&1
: > "$OUT/summary.txt"

# stage NAME LIMIT_S COMMAND...: runs COMMAND under `timeout LIMIT_S` (less where less budget is
# left; skipped where under a quarter of LIMIT_S is), logging to logs/NAME.log.
stage() {
  local name=$1 limit=$2; shift 2
  [[ ",$stages," == *",$name,"* ]] || return 0
  local left=$((BUDGET_S - (SECONDS - start)))
  if (( left < limit / 4 )); then
    echo "$name: SKIPPED ($left s of the budget left, it takes up to $limit s): run it in a second call" >> "$OUT/summary.txt"
    return 0
  fi
  (( limit > left )) && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  local verdict=ok; (( rc == 124 )) && verdict="TIMED OUT after $limit s"; (( rc != 0 && rc != 124 )) && verdict="FAILED (exit $rc)"
  echo "$name: $verdict, $((SECONDS - t0)) s; $(tail -1 "$LOGS/$name.log" | cut -c1-200)" >> "$OUT/summary.txt"
}

if [[ ",$stages," == *",build,"* || ",$stages," == *",compare,"* ]]; then  # the old header: one unit, minutes
  python3 tools/compare_tuned.py --op qk_norm_rope --build-only --old-kernels "$OLD_KERNELS" \
    --old-commit "$OLD_COMMIT" --old-version "$OLD_VERSION" > "$LOGS/old_build.log" 2>&1 &
  old_build=$!
fi
stage build 150 python3 -c "
from cookbook import cuda, registry
results = cuda.build([i.extension for i in registry.implementations('qk_norm_rope') if i.extension is not None])
failed = {n: r for n, r in results.items() if isinstance(r, Exception)}
for n, r in results.items(): print(n, r if n in failed else f'{r.seconds:.1f} s')
raise SystemExit(1 if failed else 0)"
stage tests 200 python3 -m pytest -q -p no:cacheprovider -W ignore::numba.core.errors.NumbaPerformanceWarning \
  tests/test_gpu_qk_norm_rope.py -k "not sanitizer"
stage sanitizer 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_qk_norm_rope.py -k sanitizer
stage integrations 90 python3 -m pytest -q -p no:cacheprovider tests/test_integrations.py
if [[ -n ${old_build:-} ]]; then wait "$old_build"; echo "old build: exit $? (logs/old_build.log)" >> "$OUT/summary.txt"; fi
stage compare 150 python3 tools/compare_tuned.py --op qk_norm_rope --old-kernels "$OLD_KERNELS" \
  --old-commit "$OLD_COMMIT" --old-version "$OLD_VERSION" --results-dir docs/results
stage bench 300 python3 -m cookbook bench --ops qk_norm_rope --impls reference cuda tuned peer \
  --out "$OUT/bench" --results-dir docs/results
stage builds 150 python3 tools/build_times.py qk_norm_rope
stage notebook 150 python3 tools/run_notebook.py notebooks/04_qk_norm_rope.py

pages=$(find docs/results notebooks -newer "$OUT/.start" -type f \( -name 'qk_norm_rope*' -o -name '04_qk_norm_rope.ipynb' \) 2>/dev/null)
[[ -n $pages ]] && tar czf "$OUT/results.tgz" $pages
echo "total: $((SECONDS - start)) s of a ${BUDGET_S} s budget; pages written: $(echo $pages | wc -w)" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
grep -q "FAILED\|TIMED OUT" "$OUT/summary.txt" && exit 1
exit 0
