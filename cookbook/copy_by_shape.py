"""How fast a plain copy of each benchmark shape's bytes is: the ceiling of "percent of copy".

The bench reports every kernel as a percent of one large device-to-device copy (COPY_BYTES,
256 MiB) measured in the same run. A kernel that reads and writes B bytes cannot beat a copy of
B / 2 bytes, and a copy of tens of MB does not reach the 256 MiB copy's rate: its ramp-up and
drain are a larger share of it. This module times, for every bench shape of the single-GPU ops,
a copy of half that shape's bytes (read + written = the shape's bytes), with the bench's own
timing (CUDA-graph replay over rotating buffers), and writes the table next to the bench pages:

    python -m cookbook.copy_by_shape --results-dir docs/results      # on a CUDA GPU

The copy is `torch.Tensor.copy_` of uint8 buffers, which is cudaMemcpyAsync device to device. Its
speed depends on the size: on the H200 a size that is not a whole number of 64 KiB blocks took up
to 1.5x longer (151 MB: 111.7 us against 72.7). So each size is rounded down to whole 64 KiB
(`copy_bytes_for`), and the exact size is timed too, in its own column.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

OPS = ("qk_norm", "qk_norm_rope", "cross_head_norm", "qk_norm_rope_cache")
BLOCK_BYTES = 64 * 1024  # cudaMemcpy D2D runs at full speed on whole blocks of this size (measured)


def copy_bytes_for(bytes_moved: int) -> int:
    """The copy matching a kernel that moves `bytes_moved` (read + written): half of it, in whole
    BLOCK_BYTES, at least one block."""
    return max(BLOCK_BYTES, bytes_moved // 2 // BLOCK_BYTES * BLOCK_BYTES)


def time_copy_us(nbytes: int) -> float:
    import torch

    from cookbook import bench

    sets = min(bench.MAX_INPUT_SETS, max(2, math.ceil(bench.L2_FLUSH_FACTOR * bench.l2_bytes() / nbytes)))
    pairs = [(torch.empty(nbytes, dtype=torch.uint8, device="cuda"), torch.ones(nbytes, dtype=torch.uint8, device="cuda"))
             for _ in range(sets)]
    median_us = bench.summarize(bench.measure(bench.device_copy, pairs).per_call_us)["median_us"]
    del pairs
    torch.cuda.empty_cache()
    return median_us


def run(ops=OPS, dtype="bfloat16") -> tuple[list[dict], float]:
    import torch

    from cookbook import bench, registry

    reference = bench.copy_bandwidth_gb_per_s()
    rows = []
    for op in ops:
        contract = registry.contract(op)
        for shape in contract.BENCH_SHAPES:
            case = bench.prepare_shape(op, contract, shape, bench.resolve_dtype(dtype))
            moved, label = case.base_row["bytes_moved"], case.base_row["label"]
            del case
            torch.cuda.empty_cache()
            nbytes = copy_bytes_for(moved)
            copy_us = time_copy_us(nbytes)
            exact_us = time_copy_us(moved // 2)
            gb_per_s = 2 * nbytes / (copy_us * 1e-6) / bench.BYTES_PER_GB
            rows.append(dict(op=op, label=label, bytes_moved=moved, copy_bytes=nbytes, copy_us=copy_us,
                             exact_bytes=moved // 2, exact_us=exact_us, gb_per_s=gb_per_s,
                             pct_of_reference=100 * gb_per_s / reference))
            print(f"{op} {label}: {copy_us:.2f} us, {rows[-1]['pct_of_reference']:.0f} % of the reference copy", flush=True)
    return rows, reference


def page(rows, meta) -> str:
    from cookbook.bench import markdown_table

    body = [(r["op"], r["label"], f"{r['bytes_moved'] / 1e6:.2f}", f"{r['copy_us']:.2f}", f"{r['gb_per_s'] / 1000:.2f}",
             f"{r['pct_of_reference']:.0f} %", f"{r['exact_us']:.2f}") for r in rows]
    table = markdown_table(["op", "shape", "MB per call (read + written)", "copy of half, us", "TB/s",
                            "% of the reference copy", "copy of the exact half (odd size), us"], body)
    return "\n".join([
        f"# A copy of each bench shape's bytes on {meta['gpu']}",
        "",
        "Written by `python -m cookbook.copy_by_shape`: do not edit by hand, run the command again.",
        "",
        f"- GPU: {meta['gpu']} ({meta['sm_count']} SMs); torch {meta['torch']}, CUDA {meta['cuda']}",
        f"- date: {meta['date']}; commit: {meta['commit']}",
        f"- command: `{meta['command']}`",
        f"- reference copy (the bench's denominator): {meta['copy_bytes'] >> 20} MiB, "
        f"{meta['copy_tb_per_s']:.2f} TB/s (bytes read + written)",
        f"- timing: {meta['timing']}",
        "- copy of half: `copy_` of uint8 buffers of half the shape's bytes, rounded down to whole 64 KiB; "
        "its percent of the reference copy is the most any kernel moving those bytes can show in the bench's "
        "'% of copy' column",
        "",
        table,
        "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cookbook.copy_by_shape", description=__doc__.split("\n")[0])
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--results-dir", default="docs/results")
    args = parser.parse_args(argv)
    import torch

    from cookbook import bench

    if not torch.cuda.is_available():
        print("copy_by_shape: needs a CUDA GPU; nothing to time here")
        return 0
    rows, reference = run(args.ops.split(","))
    command = "python -m cookbook.copy_by_shape " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = bench.metadata(command.strip(), reference, bench.resolve_dtype("bfloat16"))
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"copy_by_shape_{meta['gpu_slug']}.md"
    path.write_text(page(rows, meta))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
