"""GPU probe (`python tools/layout_probe.py [cross_head_norm|qk_norm]`; results in
docs/results/cross_head_norm_h200_history.md and docs/qk_norm.md): the op's fastest CUDA C kernel (`backend="cuda"`) with q and k as views
of one fused qkv tensor (the bench's layout: for cross_head_norm at 8192 a q row of 16 KB in
every 48 KB, for qk_norm at 8/1 heads q's 2 KB and k's 256 bytes in every 2.5 KB) against q and k
as separate contiguous tensors, alternating twice per shape. Timed with the bench's machinery
(CUDA-graph replay over rotating input sets), as % of the bench's 256 MiB reference copy."""
import math
import sys

import torch

from cookbook import bench, registry
from cookbook.ops import cross_head_norm, qk_norm

# op -> (shapes, make_inputs(shape, seed, fused_qkv), bytes read + written per call)
CASES = {
    "cross_head_norm": (
        [(2048, 8192), (8192, 8192), (1024, 4096)],
        lambda shape, seed, fused: cross_head_norm.make_inputs(shape[0], shape[1], shape[1], torch.bfloat16, "cuda",
                                                               seed=seed, fused_qkv=fused),
        lambda shape: 2 * 2 * shape[0] * shape[1] * 2,
    ),
    "qk_norm": (
        [(8192, 8, 1, 128), (8192, 64, 8, 128), (1024, 64, 8, 128)],
        lambda shape, seed, fused: qk_norm.make_inputs(*shape, torch.bfloat16, "cuda", seed=seed, fused_qkv=fused),
        lambda shape: 2 * shape[0] * (shape[1] + shape[2]) * shape[3] * 2,
    ),
}

op = sys.argv[1] if len(sys.argv) > 1 else "cross_head_norm"
shapes, make, bytes_moved = CASES[op]
impl = registry.fastest(op)
ref = bench.copy_bandwidth_gb_per_s()
print(f"{op} {impl.name}; copy {ref / 1000:.3f} TB/s")
for shape in shapes:
    for fused in (True, False, True, False):
        nbytes = bytes_moved(shape)
        count = min(bench.MAX_INPUT_SETS, max(2, math.ceil(bench.L2_FLUSH_FACTOR * bench.l2_bytes() / nbytes)))
        sets = []
        for seed in range(count):
            a = make(shape, seed, fused)
            sets.append((a["q"], a["k"], a["q_weight"], a["k_weight"]))
        timing = bench.measure(lambda q, k, qw, kw: impl.fn(q, k, qw, kw, 1e-6, 0.0, "fused"), sets)
        us = bench.summarize(timing.per_call_us)["median_us"]
        pct = 100 * (nbytes / (us * 1e-6) / bench.BYTES_PER_GB) / ref
        label = "x".join(map(str, shape))
        print(f"{label} fused_qkv={fused!s:5s} {us:8.2f} us {pct:5.1f} %", flush=True)
        del sets
        torch.cuda.empty_cache()
