#!/usr/bin/env bash
# qk_norm_rope_cache on one GPU machine (an H100 or H200 with 16 cores): peers, build, tests, benchmark
# with the split-path peers and the copy ceiling, build times, notebook; each stage within its own time
# limit and all within BUDGET_S, so that one call ends inside a caller's limit (a stage that no longer
# fits is skipped and named in the summary: call again with those stages on the same warm machine,
# whose build caches are kept).
#
#   bash tools/gpu_qk_norm_rope_cache.sh [stages]
#     stages       comma-separated, run in this order (default: all of them):
#       peers        the peer wheels of .whl/ (WHEELS) installed without network into build/peers
#                    (put on PYTHONPATH), and `python -m cookbook.peers build --ops qk_norm_rope_cache`:
#                    their JIT kernels compiled before any timing
#       build        every qk_norm_rope_cache extension (the three rungs and the tuned kernel) in parallel
#       tests        tests/test_gpu_qk_norm_rope_cache.py but its sanitizer test (every rung and the tuned
#                    kernel at scale, FP8 bytes, the policy, graphs, compile, opcheck)
#       sanitizer    its compute-sanitizer memcheck test
#       bench        the benchmark of qk_norm_rope_cache with every peer, --results-dir docs/results ->
#                    docs/results/qk_norm_rope_cache_<gpu>.{md,json,png}
#       copy         the copy ceiling of every bench shape's bytes, every single-GPU op (cookbook.copy_by_shape) ->
#                    docs/results/copy_by_shape_<gpu>.md
#       props        tests/test_qk_norm_rope_cache.py on the GPU: its property tests draw GPU-sized shapes
#                    (hypothesis' gpu profile) for every implementation
#       builds       tools/build_times.py qk_norm_rope_cache: first auto call and the whole op from
#                    empty caches -> docs/results/qk_norm_rope_cache_<gpu>_builds.{md,json}
#       notebook     tools/run_notebook.py notebooks/06_qk_norm_rope_cache.py (writes the .ipynb)
#
# What comes back in $OUT (three files: a caller's output folder may take only a few): summary.txt
# (each stage's status and seconds, and what was skipped), env.txt, and results.tgz: one log per
# stage (logs/), the bench's own output (bench/), the pages written under docs/results/ and the
# executed notebook. A failing stage does not stop the later ones.
set -uo pipefail
stages=${1:-peers,build,tests,sanitizer,bench,copy,props,builds,notebook}
OUT=${OUT:-/tmp/out}; WORK=$(mktemp -d); LOGS=$WORK/logs; mkdir -p "$OUT" "$LOGS"
BUDGET_S=${BUDGET_S:-580}
WHEELS=${WHEELS:-.whl}
export PYTHONUNBUFFERED=1 COOKBOOK_BUILD_DIR=${COOKBOOK_BUILD_DIR:-$PWD/build/cookbook}
export PYTHONPATH="$PWD:$PWD/build/peers${PYTHONPATH:+:$PYTHONPATH}" NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
start=$SECONDS
touch "$WORK/.start"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -1
  echo "cores: $(nproc); stages: $stages; budget ${BUDGET_S} s; wheels: $(ls "$WHEELS" 2>/dev/null | tr '\n' ' ')"
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

install_peers() {
  if compgen -G "$WHEELS/*.whl" > /dev/null; then
    python3 -m pip install --no-index --no-deps --quiet --target "$PWD/build/peers" "$WHEELS"/*.whl || return 1
  else
    echo "no wheels in $WHEELS: the peers that are not installed are reported as such"
  fi
  python3 -m cookbook.peers --ops qk_norm_rope_cache
  python3 -m cookbook.peers build --ops qk_norm_rope_cache
}

export -f install_peers; export WHEELS  # `timeout` runs programs, not shell functions
stage peers 200 bash -c install_peers
stage build 150 python3 -c "
from cookbook import cuda, registry
results = cuda.build([i.extension for i in registry.implementations('qk_norm_rope_cache') if i.extension is not None])
failed = {n: r for n, r in results.items() if isinstance(r, Exception)}
for n, r in results.items(): print(n, r if n in failed else f'{r.seconds:.1f} s')
raise SystemExit(1 if failed else 0)"
stage tests 300 python3 -m pytest -q -p no:cacheprovider -W ignore::numba.core.errors.NumbaPerformanceWarning \
  tests/test_gpu_qk_norm_rope_cache.py -k "not sanitizer"
stage sanitizer 150 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_qk_norm_rope_cache.py -k sanitizer
stage bench 300 python3 -m cookbook bench --ops qk_norm_rope_cache --out "$WORK/bench" --results-dir docs/results
stage copy 200 python3 -m cookbook.copy_by_shape --results-dir docs/results
stage props 300 python3 -m pytest -q -p no:cacheprovider -W ignore::numba.core.errors.NumbaPerformanceWarning \
  tests/test_qk_norm_rope_cache.py
stage builds 150 python3 tools/build_times.py qk_norm_rope_cache
stage notebook 300 python3 tools/run_notebook.py notebooks/06_qk_norm_rope_cache.py

pages=$(find docs/results notebooks -newer "$WORK/.start" -type f \( -name 'qk_norm_rope_cache*' -o -name 'copy_by_shape_*' \
  -o -name '06_qk_norm_rope_cache.ipynb' \) 2>/dev/null)
tar czf "$OUT/results.tgz" $pages -C "$WORK" logs $(cd "$WORK" && ls -d bench 2>/dev/null)
echo "total: $((SECONDS - start)) s of a ${BUDGET_S} s budget; pages written: $(echo $pages | wc -w)" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
grep -q "FAILED\|TIMED OUT" "$OUT/summary.txt" && exit 1
exit 0
