#!/usr/bin/env bash
# One device-tool call on a multi-GPU machine for the collective op tp_qk_norm: topology, build,
# the torchrun GPU checks, compute-sanitizer on a small case, then the TP benchmark.
#   bash tools/gpu_tp_run.sh [checks|bench|all] [bench shapes: quick|full|decode (no results pages)]
set -uo pipefail
what=${1:-all}; shapes=${2:-full}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COOKBOOK_BUILD_DIR=${COOKBOOK_BUILD_DIR:-/tmp/cookbook-build}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
nproc=$(python3 -c "import torch; print(torch.cuda.device_count())")
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  nvidia-smi topo -m
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/env.txt"
python3 -c "from cookbook import cuda; cuda.load('tp_qk_norm'); cuda.load('cross_head_norm')" 2>&1 | tail -20
status=0
if [[ $what == checks || $what == all ]]; then
  timeout 400 python3 -m torch.distributed.run --standalone --nproc-per-node="$nproc" tests/tp_gpu_checks.py 2>&1 \
    | grep -v "^W1\|NumbaPerformanceWarning\|warn(" | tee "$OUT/checks.log" | tail -40
  status=${PIPESTATUS[0]}
  timeout 200 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all --error-exitcode 3 \
    python3 -m torch.distributed.run --standalone --nproc-per-node="$nproc" tests/tp_gpu_checks.py --small 2>&1 \
    | tail -25 | tee "$OUT/sanitizer.log"
  echo "sanitizer exit: ${PIPESTATUS[0]}" | tee -a "$OUT/sanitizer.log"
  # The API errors it leaves out above (PyTorch's symmetric-memory allocator probing the driver):
  timeout 120 compute-sanitizer --tool memcheck --target-processes all --print-limit 3 \
    python3 -m torch.distributed.run --standalone --nproc-per-node="$nproc" tests/tp_gpu_checks.py --small \
    > "$OUT/sanitizer_api.log" 2>&1
fi
if [[ $what == bench || $what == all ]]; then
  if [[ $shapes == decode ]]; then bench=(python3 -m cookbook.bench.tp --no-results); else bench=(python3 -m cookbook bench --ops tp_qk_norm); fi
  timeout 420 "${bench[@]}" --nproc "$nproc" --shapes "$shapes" --out "$OUT/bench" 2>&1 \
    | grep -v "^W1\|NumbaPerformanceWarning\|warn(" | tee "$OUT/bench.log" | tail -70
  tar czf "$OUT/results.tgz" docs/results/tp_qk_norm_* "$OUT/bench" 2>/dev/null
fi
exit $status
