#!/usr/bin/env bash
# tp_qk_norm's ladder and tuned kernel (kernels_cuda/tp_qk_norm/) on a machine with NPROC GPUs (2 or 4),
# within about 8 minutes: from the repository root,
#   OUT=/some/dir [NPROC=4] [BENCH_TOKENS=1,...] [B2B_TOKENS=1,128,2048,16384] bash tools/gpu_tp_ladder.sh
# (BENCH_TOKENS: the graph benchmark's token counts, default the benchmark's MiniMax-M2 list)
# Stages (each with its own time limit; summary.txt says what each did):
#   peers        the peer wheels of .whl/ (WHEELS) installed without network into build/peers (SGLang's TP kernel)
#   build_tuned  the tuned extension alone from an empty cache, timed (what the first backend="auto" call pays)
#   build_all    every tp_qk_norm extension (rungs v1-v8, tuned) and cross_head_norm's tuned kernel, in parallel
#   checks       tests/tp_gpu_checks.py --quick at NPROC ranks (tuned, every rung), then at 2 ranks where NPROC > 2
#   explain      tests/test_gpu_explain.py -k tp on one GPU: the GPU's plan equals the host's at TP=2, 4 and 8
#   bench        the TP=NPROC benchmark at MiniMax-M2's widths: every rung, tuned, the local shard and SGLang's
#                kernel, graph replays, pages into docs/results
#   b2b          the same rows timed back to back (SGLang's method) at B2B_TOKENS
#   bench_2, b2b_2  where NPROC > 2: the same two benchmarks at TP=2
#   sanitizer    compute-sanitizer memcheck of tests/tp_gpu_checks.py --small at 2 ranks (every rung, tuned)
#   checks_2     where NPROC > 2: the checks again at 2 ranks
# What comes back in $OUT (3 files): env.txt, summary.txt, results.tgz (logs/, pages/: the tp_qk_norm pages
# of docs/results after the run, and the benchmark's JSON).
set -uo pipefail
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs; mkdir -p "$OUT" "$LOGS"
BUDGET_S=${BUDGET_S:-470}; WHEELS=${WHEELS:-.whl}; NPROC=${NPROC:-2}; B2B_TOKENS=${B2B_TOKENS:-1,128,2048,16384}
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0 PATH="$PATH:/usr/local/cuda/bin"
export PYTHONPATH="$PWD:$PWD/build/peers${PYTHONPATH:+:$PYTHONPATH}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 SGLANG_SKIP_P2P_CHECK=1  # never multicast
export CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((NPROC - 1)))}
start=$SECONDS; status=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
  git log -1 --format='commit %h %s' 2>/dev/null; nproc
} > "$OUT/env.txt" 2>&1
: > "$OUT/summary.txt"

stage() {  # stage NAME SECONDS COMMAND...: within SECONDS or what is left of the budget (less 20 s for the tarball)
  local name=$1 want=$2; shift 2
  local left=$((BUDGET_S - (SECONDS - start) - 20)); local limit=$((want < left ? want : left))
  if ((limit < 20)); then echo "$name: skipped, ${left}s left" >> "$OUT/summary.txt"; return; fi
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - t0)) s (limit $limit); $(grep -v '^W1\|warn' "$LOGS/$name.log" | tail -1 | cut -c1-200)" >> "$OUT/summary.txt"
  ((rc == 0)) || status=1
}

install_peers() {
  if compgen -G "$WHEELS/*.whl" > /dev/null; then
    python3 -m pip install --no-index --no-deps --quiet --target "$PWD/build/peers" "$WHEELS"/*.whl || return 1
  else
    echo "no wheels in $WHEELS: SGLang's row says it is not installed"
  fi
}
export -f install_peers; export WHEELS
stage peers 90 bash -c install_peers

# The tuned extension from an empty cache (its own build directory), on every core: the first auto call's build.
export COOKBOOK_BUILD_DIR=$PWD/build/tp_tuned_cold; rm -rf "$COOKBOOK_BUILD_DIR"
stage build_tuned 120 python3 -c "
import time
from cookbook import cuda
t0 = time.perf_counter(); cuda.TpOps(cuda.tp_tuned()); print(f'tp_qk_norm_tuned from an empty cache: {time.perf_counter() - t0:.1f} s')"
export COOKBOOK_BUILD_DIR=$PWD/build/cookbook
stage build_all 200 python3 -c "
from cookbook import cuda, registry
exts = [i.extension for i in registry.implementations('tp_qk_norm', ('cuda', 'tuned'))]
exts.append(registry.get('cross_head_norm', 'cuda_tuned').extension)
results = cuda.build(exts)
for name, r in results.items(): print(name, r)
raise SystemExit(any(isinstance(r, Exception) for r in results.values()))"
ranks() { echo python3 -m torch.distributed.run --standalone --nproc-per-node="$1"; }
stage checks 130 $(ranks "$NPROC") tests/tp_gpu_checks.py --quick
CUDA_VISIBLE_DEVICES=0 stage explain 60 python3 -m pytest -q -x tests/test_gpu_explain.py -k tp
rows=$(python3 -c "from cookbook import registry; print(','.join([i.name for i in registry.implementations('tp_qk_norm', ('cuda', 'tuned'))] + ['local_cross_head_norm', 'sglang_fused_parallel_qknorm']))")
stage bench 200 python3 -m cookbook.bench.tp --nproc "$NPROC" --shapes minimax ${BENCH_TOKENS:+--tokens "$BENCH_TOKENS"} --impls "$rows" --results-dir docs/results \
  --out "$OUT/bench_graph"
stage b2b 150 python3 -m cookbook.bench.tp --nproc "$NPROC" --shapes minimax --tokens "$B2B_TOKENS" --timing back_to_back \
  --impls "$rows" --results-dir docs/results --out "$OUT/bench_b2b"
export CUDA_VISIBLE_DEVICES=0,1
if ((NPROC > 2)); then  # the TP=2 pages too
  stage bench_2 150 python3 -m cookbook.bench.tp --nproc 2 --shapes minimax ${BENCH_TOKENS:+--tokens "$BENCH_TOKENS"} --impls "$rows" --results-dir docs/results \
    --out "$OUT/bench_graph_2"
  stage b2b_2 120 python3 -m cookbook.bench.tp --nproc 2 --shapes minimax --tokens "$B2B_TOKENS" --timing back_to_back \
    --impls "$rows" --results-dir docs/results --out "$OUT/bench_b2b_2"
fi
stage sanitizer 90 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all --error-exitcode 3 \
  $(ranks 2) tests/tp_gpu_checks.py --small
((NPROC > 2)) && stage checks_2 100 $(ranks 2) tests/tp_gpu_checks.py --quick
echo "done in $((SECONDS - start)) s, status $status" >> "$OUT/summary.txt"
mkdir -p "$OUT/pages" && cp docs/results/tp_qk_norm_* "$OUT/pages/" 2>/dev/null
(cd "$OUT" && tar czf results.tgz logs pages $(ls -d bench_* 2>/dev/null))
rm -rf "$LOGS" "$OUT"/bench_* "$OUT/pages"
exit $status
