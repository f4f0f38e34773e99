"""GPU probe (`python tools/layout_probe.py`; results in docs/cross_head_norm.md): cross_head_norm
cuda_v8 with q and k as views of one fused qkv tensor (the bench's layout: a q row of 16 KB in
every 48 KB) against q and k as separate contiguous tensors, at 2048 x 8192, 8192 x 8192 and
1024 x 4096 bf16, alternating twice. Timed with the bench's machinery (CUDA-graph replay over
rotating input sets), as % of the bench's 256 MiB reference copy."""
import math, torch
from cookbook import bench, registry
from cookbook.ops import cross_head_norm as chn
impl = registry.get("cross_head_norm", "cuda_v8")
fn = impl.fn
ref = bench.copy_bandwidth_gb_per_s()
print(f"copy {ref/1000:.3f} TB/s")
for t, h in ((2048, 8192), (8192, 8192), (1024, 4096)):
    for fused in (True, False, True, False):
        nbytes = 2 * 2 * t * h * 2
        count = min(bench.MAX_INPUT_SETS, max(2, math.ceil(bench.L2_FLUSH_FACTOR * bench.l2_bytes() / nbytes)))
        sets = []
        for i in range(count):
            a = chn.make_inputs(t, h, h, torch.bfloat16, "cuda", seed=i, fused_qkv=fused)
            sets.append((a["q"], a["k"], a["q_weight"], a["k_weight"]))
        us = bench.summarize(bench.measure(lambda q, k, qw, kw: fn(q, k, qw, kw, 1e-6, 0.0, "fused"), sets).per_call_us)["median_us"]
        pct = 100 * (nbytes / (us * 1e-6) / bench.BYTES_PER_GB) / ref
        print(f"{t}x{h} fused_qkv={fused!s:5s} {us:8.2f} us {pct:5.1f} %", flush=True)
        del sets
        torch.cuda.empty_cache()
