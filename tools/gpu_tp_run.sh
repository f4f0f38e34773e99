#!/usr/bin/env bash
# One timed run on a multi-GPU machine for the collective op tp_qk_norm, in stages, each
# within its own time budget and all within BUDGET_S (so that the run ends inside a caller's time limit):
#
#   bash tools/gpu_tp_run.sh [stages]        stages: comma-separated; they run in this order
#     build      the tp_qk_norm and cross_head_norm extensions, in parallel (into build/, which a
#                later call on the same warm machine reuses)
#     checks     tests/tp_gpu_checks.py on every GPU (CHECKS=quick|full, default quick)
#     sweep      the TP benchmark on every GPU: MiniMax-M2's widths, every CUDA C version, the local
#                shard and NCCL's all-reduce of the sums; writes $PAGES/tp_qk_norm_<gpu>x<tp>.md and
#                .json after every shape (a run cut short keeps its rows). PAGES defaults to
#                $OUT/pages, so a partial sweep never replaces a page of record; the pages of record:
#                SHAPES=full PAGES=docs/results (every implementation and shape, a longer call)
#     sanitizer  compute-sanitizer memcheck of the small case on every GPU
#     checks2    the GPU checks on 2 of the GPUs (--quick)
#     b2b        the sweep timed as SGLang's benchmark did (--timing back_to_back) at 1, 128, 2048
#                and 16384 tokens: $PAGES/tp_qk_norm_<gpu>x<tp>_back_to_back.md
#     sweep2     the sweep on 2 of the GPUs: $PAGES/tp_qk_norm_<gpu>x2.md
#   default: all of them; a stage that no longer fits the budget is skipped (env.txt says so), for
#   a second call: bash tools/gpu_tp_run.sh <the skipped stages>
#
# What comes back in $OUT (few files, so that a remote run can copy them back): env.txt (the machine, and
# each stage's limit, exit status and time) and results.tgz: the pages ($PAGES), one
# log per stage (logs/) and the benchmark's JSON (bench_*/).
set -uo pipefail
stages=${1:-build,checks,sweep,sanitizer,checks2,b2b,sweep2}
OUT=${OUT:-/tmp/out}; LOGS=$OUT/logs; mkdir -p "$OUT" "$LOGS"
BUDGET_S=${BUDGET_S:-470}; CHECKS=${CHECKS:-quick}; SHAPES=${SHAPES:-minimax}; PAGES=${PAGES:-$OUT/pages}
export PYTHONUNBUFFERED=1 COOKBOOK_BUILD_DIR=${COOKBOOK_BUILD_DIR:-$PWD/build/cookbook}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
start=$SECONDS
nproc=$(python3 -c "import torch; print(torch.cuda.device_count())")
status=0
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
  git log -1 --format='commit %h %s' 2>/dev/null
  echo "stages $stages; checks $CHECKS; shapes $SHAPES; budget ${BUDGET_S}s"
} 2>&1 | tee "$OUT/env.txt"

# stage NAME SECONDS COMMAND...: run it with a timeout of SECONDS or what is left of the budget
# (less 20 s for the tarball), its output in $LOGS/NAME.log; a failure sets the exit status.
stage() {
  local name=$1 want=$2; shift 2
  local left=$((BUDGET_S - (SECONDS - start) - 20))
  local limit=$((want < left ? want : left))
  if ((limit < 20)); then echo "== $name: skipped, ${left}s left" | tee -a "$OUT/env.txt"; return; fi
  echo "== $name (limit ${limit}s, $((SECONDS - start))s in)" | tee -a "$OUT/env.txt"
  timeout --kill-after=10 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  grep -v "^W1\|NumbaPerformanceWarning\|warn(" "$LOGS/$name.log" | tail -30
  echo "== $name: exit $rc after $((SECONDS - start))s" | tee -a "$OUT/env.txt"
  ((rc == 0)) || status=1
}
has() { [[ ",$stages," == *",$1,"* ]]; }
ranks() { echo python3 -m torch.distributed.run --standalone --nproc-per-node="$1"; }  # (timeout runs no shell function)
build='python3 -c "from cookbook import cuda, registry; cuda.build([i.extension for i in registry.implementations(\"tp_qk_norm\", (\"cuda\", \"tuned\"))])" & tp=$!
python3 -c "from cookbook import cuda, registry; cuda.load_extension(registry.get(\"cross_head_norm\", \"cuda_tuned\").extension)"; rc=$?; wait $tp && exit $rc'
if [[ $SHAPES == full ]]; then rows=(); else  # every CUDA C version, the local shard, NCCL's all-reduce of the sums
  rows=(--impls "$(python3 -c "from cookbook import registry; print(','.join([i.name for i in registry.implementations('tp_qk_norm', ('cuda', 'tuned'))] + ['local_cross_head_norm', 'nccl_all_reduce_sums']))")")
fi
checks_args=(); [[ $CHECKS == quick ]] && checks_args=(--quick)

has build && stage build 300 bash -c "$build"
has checks && stage checks 170 $(ranks "$nproc") tests/tp_gpu_checks.py ${checks_args[@]+"${checks_args[@]}"}
has sweep && stage sweep 200 python3 -m cookbook.bench.tp --nproc "$nproc" --shapes "$SHAPES" ${rows[@]+"${rows[@]}"} \
  --results-dir "$PAGES" --out "$OUT/bench_sweep"
has sanitizer && stage sanitizer 100 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
  --error-exitcode 3 $(ranks "$nproc") tests/tp_gpu_checks.py --small
has checks2 && CUDA_VISIBLE_DEVICES=0,1 stage checks2 120 $(ranks 2) tests/tp_gpu_checks.py --quick
has b2b && stage b2b 100 python3 -m cookbook.bench.tp --nproc "$nproc" --shapes minimax --tokens 1,128,2048,16384 \
  --timing back_to_back --impls cuda_v4,cuda_v5,cuda_v6,cuda_v7,cuda_v8,cuda_tuned,local_cross_head_norm \
  --results-dir "$PAGES" --out "$OUT/bench_b2b"
has sweep2 && CUDA_VISIBLE_DEVICES=0,1 stage sweep2 200 python3 -m cookbook.bench.tp --nproc 2 --shapes "$SHAPES" \
  ${rows[@]+"${rows[@]}"} --results-dir "$PAGES" --out "$OUT/bench_sweep2"
echo "done in $((SECONDS - start))s, status $status" | tee -a "$OUT/env.txt"
mkdir -p "$OUT/pages_all" && cp "$PAGES"/tp_qk_norm_* "$OUT/pages_all/" 2>/dev/null  # (PAGES may be docs/results)
(cd "$OUT" && tar czf results.tgz logs bench_* pages_all 2>/dev/null)
rm -rf "$OUT/logs" "$OUT"/bench_* "$OUT/pages_all" "$OUT/pages"
exit $status
