#!/usr/bin/env bash
# One device-tool call: environment, GPU test suite, then the benchmark; logs and results go to
# $OUT (the device tool brings back at most 8 files, so results travel as one tarball).
#   bash tools/gpu_run.sh [tests|bench|all] [extra pytest args...]
set -uo pipefail
what=${1:-all}; shift || true
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 COOKBOOK_BUILD_DIR=/tmp/cookbook-build
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, numba, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numba', numba.__version__, 'numpy', numpy.__version__)"
  nvcc --version | tail -1
} 2>&1 | tee "$OUT/env.txt"
status=0
if [[ $what == tests || $what == all ]]; then
  python3 -c "from cookbook import registry; from cookbook.bench import sweep; [sweep.build_cuda_kernels(op, registry.implementations(op)) for op in registry.ops()]" 2>&1 | tail -20
  python3 -m pytest -q --maxfail=25 -p no:cacheprovider -W ignore::numba.core.errors.NumbaPerformanceWarning tests "$@" 2>&1 | tee "$OUT/pytest.log" | tail -40
  status=${PIPESTATUS[0]}
fi
if [[ $what == bench || $what == all ]]; then
  python3 -m cookbook bench --out "$OUT/bench" --results-dir docs/results 2>&1 | tee "$OUT/bench.log" | tail -60
  tar czf "$OUT/results.tgz" docs/results "$OUT/bench" 2>/dev/null
fi
exit $status
