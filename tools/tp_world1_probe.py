"""GPU probe (`python tools/tp_world1_probe.py [--ncu]`; results in docs/tp_qk_norm.md, "Where v7's
time goes"): tp_qk_norm's fused kernels on ONE GPU, in a process group of one rank. The kernel
then pushes its partial sums into its own buffer and finds them there at once, so what is left is
the kernel's own memory path and instructions, without NVLink and without the other rank's
timing: the way to tell whether a prefill version is slow for its exchange or for itself.

Every row is timed with the TP bench's machinery (CUDA-graph replay over rotating input sets,
after a check against the float64 reference) beside the same shard's single-GPU
`cross_head_norm` (`local`). With --ncu, each fused version instead runs once under Nsight
Compute at the first shape, and the table is cookbook.ncu's (issue slots busy, occupancy, stalls).

    python tools/tp_world1_probe.py --shapes 16384x3072x512,16384x768x128 --impls local,cuda_v7,cuda_v8,cuda_v9
    python tools/tp_world1_probe.py --ncu --impls local,cuda_v7,cuda_v8,cuda_v9
"""
import argparse
import os
import shutil
import subprocess
import sys

import torch
import torch.distributed as dist

from cookbook import bench, registry
from cookbook import bench_tp as tp_bench

LOCAL = "local"
DEFAULT_SHAPES = "16384x3072x512,8192x3072x512,2048x3072x512,16384x2048x256,16384x1536x256,16384x768x128"
MEMORY_FRACTION = 0.5  # of the GPU, for the rotating input sets


def one_rank_group() -> None:
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29533"), ("RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))


def call_of(name: str, sets):
    """(fn, per-set args) of a row: a registered tp_qk_norm implementation or the local shard."""
    if name == LOCAL:
        local = registry.fastest("cross_head_norm").fn
        return local, [(a.q, a.k, a.q_weight, a.k_weight, a.eps, a.weight_offset, a.rounding) for a, _ in sets]
    return registry.get("tp_qk_norm", name).build(), [bench.positional(a) for a, _ in sets]


def time_rows(shapes, names, rounds: int) -> None:
    props = torch.cuda.get_device_properties(0)
    for shape in shapes:
        t, q_width, k_width = shape
        nbytes = 2 * t * (q_width + k_width) * 2  # bf16, read + written
        count = bench.rotating_set_count(nbytes, nbytes, props.L2_cache_size, int(props.total_memory * MEMORY_FRACTION))
        full, sets = tp_bench.make_sets(shape, torch.bfloat16, 0, 1, count)
        for _ in range(rounds):
            for name in names:
                check = "" if name == LOCAL else tp_bench.check_once(registry.get("tp_qk_norm", name), full, 0, 1,
                                                                     torch.bfloat16) or "ok"
                fn, per_set = call_of(name, sets)
                estimate, _ = tp_bench.time_per_call(fn, per_set, len(per_set))
                per_call, method = tp_bench.time_per_call(fn, per_set, tp_bench.calls_for(bench.percentile(estimate, 50),
                                                                                          len(per_set)))
                s = bench.summarize(per_call)
                print(f"T={t} {q_width}/{k_width} {name:10s} {s['median_us']:8.2f} us ({s['p20_us']:.2f}-"
                      f"{s['p80_us']:.2f}) {nbytes / s['median_us'] / 1e3:6.0f} GB/s {method} {check[:100]}", flush=True)


def profiled_call(name: str, shape) -> None:
    """ncu's target: one warm call, then one call inside the profiled range."""
    _, sets = tp_bench.make_sets(shape, torch.bfloat16, 0, 1, 1)
    fn, per_set = call_of(name, sets)
    fn(*per_set[0])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn(*per_set[0])
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def ncu_rows(shape_text: str, names) -> None:
    from cookbook import ncu

    launches, rows = [], []
    for name in names:
        command = [shutil.which("ncu"), "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page",
                   "details"]
        for section in ncu.SECTIONS:
            command += ["--section", section]
        command += ["--metrics", ",".join(ncu.EXTRA_METRICS), sys.executable, __file__, "--child", name,
                    "--shapes", shape_text]
        run = subprocess.run(command, capture_output=True, text=True)
        found = ncu.parse_details(run.stdout)
        if not found:
            print(f"ncu failed on {name}:", run.stdout[-2000:], run.stderr[-2000:], sep="\n")
        launches += found
        rows += [name] * len(found)
    print(ncu.table(launches, rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="TxQxK shard shapes, comma-separated")
    parser.add_argument("--impls", default="local,cuda_v7,cuda_v8,cuda_v9", help=f"rows: tp_qk_norm implementations, {LOCAL!r}")
    parser.add_argument("--rounds", type=int, default=2, help="times each shape's rows run, alternating")
    parser.add_argument("--ncu", action="store_true", help="profile each row once under ncu at the first shape")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    names = args.impls.split(",")
    if args.ncu:
        ncu_rows(args.shapes.split(",")[0], names)
        return 0
    one_rank_group()
    try:
        if args.child:
            profiled_call(args.child, shapes[0])
        else:
            time_rows(shapes, names, args.rounds)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
