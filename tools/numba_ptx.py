"""Instruction counts and registers of the Numba qk_norm_rope kernels v2 and v3, without a GPU.

    LD_LIBRARY_PATH=/tmp/nvrtc/x/nvidia/cu13/lib CUDA_HOME=/usr/local/cuda-13.0 \\
        NVDISASM=/tmp/nvdisasm_whl/x/nvidia/cu13/bin/nvdisasm python tools/numba_ptx.py [--ops] [--dump DIR] [--all]

(NVRTC from the nvidia-cuda-nvrtc wheel, nvdisasm from the nvidia-cuda-nvdisasm wheel, each
`pip download`ed and unzipped; ptxas from the CUDA toolkit.)

Compiles each kernel for sm_90 with the argument types the GPU launch passes for the bench's
inputs (bf16 q and k as strided views of a fused qkv tensor, bf16 weights, a float32 cache,
int64 positions; head_dim 128, fused rounding) and prints, per kernel:

* PTX: instructions in the kernel's PTX (no directives, labels or parameter loads), with its
  loads, stores, 64-bit integer ops (arithmetic, compares, selects and conversions on s64/u64/
  b64) and branches;
* SASS: the instructions ptxas makes of it (without the subroutines it calls: 64-bit division,
  the float division's slow path), and `path`, the longest path through them: an upper bound on
  what one warp issues (the kernels have no loops once unrolled; a path takes one side of every
  branch, so dead sides such as v3's pass-through words at full rope count only where longer);
* rows/warp, and path / (rows/warp): the upper bound per (token, head) row;
* registers per thread and stack frame bytes (spills, local arrays left in memory), from ptxas.

v2 takes the rounding and the layout at run time: "v2" is the kernel as launched, with both
paths; the "(pruned)" lines compile it with those two as literals, so Numba drops the other
paths and what is left is what one launch executes. v3 fixes both at build time. Static counts
are not dynamic counts: the loops have constant trip counts and are unrolled, which makes
the longest path close to the work of a full-rope row. --all compiles every v3 specialization
(layout, rounding, weight and cache storage, head_dim buckets 64 to 1024) and prints its
registers: the check that each one builds for the GPU.

NUMBA_ENABLE_CUDASIM must be unset. The SASS columns need nvdisasm (the nvidia-cuda-nvdisasm
wheel has one); without it they print '-'.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
assert not os.environ.get("NUMBA_ENABLE_CUDASIM"), "PTX needs the real CUDA target: unset NUMBA_ENABLE_CUDASIM"

from numba import cuda, types  # noqa: E402
from numba.cuda import dispatcher  # noqa: E402

from kernels_numba import qk_norm_rope as m  # noqa: E402
from kernels_numba.helpers import BF16, FP32, WARP_SIZE  # noqa: E402

CC = (9, 0)
# A device function called from a kernel compiles for the current device's compute capability;
# with no GPU (no driver) there is none, so name the target here.
dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=CC)

PTXAS = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "ptxas"
NVDISASM = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
HEAD_DIM = 128
LAYOUT = {True: "neox", False: "interleaved"}
POSITIONS = types.Array(types.int64, 1, "C")
F32_CACHE = types.Array(types.float32, 2, "C")
# v2: bf16 travels as int16 bits; scalars eps, weight_offset, hf, is_neox, rope_dim, position_offset
V2_ROWS = types.Array(types.int16, 3, "A")  # a strided (fused-qkv) view
V2_WEIGHT = types.Array(types.int16, 1, "C")
# v3: bf16 as int32 words; scalars eps, weight_offset, rope_dim, position_offset, 1 / head_dim
V3_ROWS = types.Array(types.int32, 3, "A")
V3_SCALARS = (types.float32, types.float32, types.uint32, types.int64, types.float32)
V3_TABLE_TYPES = {"float32": (types.float32, 1), "bfloat16 words": (types.int32, 1)}
INT_ALU = {"add", "sub", "mul", "mad", "shl", "shr", "and", "or", "xor", "not", "neg", "selp", "setp", "min", "max",
           "div", "rem", "cvt"}
SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
SASS_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def v2_kernels():
    v2 = m.make_qk_norm_rope_kernel_v2(BF16, BF16, FP32, HEAD_DIM).py_func
    scalars = (types.float32, types.float32, types.boolean, types.boolean, types.int64, types.int64)
    yield "v2", v2, (V2_ROWS, V2_ROWS, V2_WEIGHT, V2_WEIGHT, F32_CACHE, POSITIONS, *scalars), 1
    for is_neox in (True, False):
        scalars = (types.float32, types.float32, types.literal(False), types.literal(is_neox), types.int64, types.int64)
        yield f"v2 {LAYOUT[is_neox]} (pruned)", v2, (V2_ROWS, V2_ROWS, V2_WEIGHT, V2_WEIGHT, F32_CACHE, POSITIONS,
                                                      *scalars), 1


def v3_kernel(is_neox, hf=False, weight=m.WORD_TABLE, cache=m.FLOAT_TABLE, head_dim=HEAD_DIM):
    fn = m.make_qk_norm_rope_kernel_v3(weight, cache, is_neox, hf, head_dim).py_func
    weight_type = types.Array(types.int32 if weight is m.WORD_TABLE else types.float32, 1, "C")
    cache_type = types.Array(types.int32 if cache is m.WORD_TABLE else types.float32, 2, "C")
    rows_per_warp = WARP_SIZE // m.row_lanes(head_dim)
    return fn, (V3_ROWS, V3_ROWS, weight_type, weight_type, cache_type, POSITIONS, *V3_SCALARS), rows_per_warp


def instructions(ptx):
    """The instruction lines of the kernel's PTX (no directives, labels, braces or param loads)."""
    lines = (line.strip() for line in ptx[ptx.index(".entry"):].splitlines())
    return [line.rstrip(";") for line in lines
            if line.endswith(";") and not line.startswith((".", "//", "ld.param")) and not line.endswith(":")]


def opcode(line):
    """The opcode of an instruction, past its guard predicate (`@%p1 bra ...`)."""
    words = line.split()
    return words[1] if words[0].startswith("@") else words[0]


def is_int64(op):
    parts = op.split(".")
    return parts[0] in INT_ALU and any(t in parts[1:] for t in ("s64", "u64", "b64"))


def ptx_counts(ptx):
    ops = Counter(opcode(line) for line in instructions(ptx))
    return dict(
        ptx=sum(ops.values()),
        loads=sum(n for op, n in ops.items() if op.startswith("ld.")),
        stores=sum(n for op, n in ops.items() if op.startswith("st.")),
        int64=sum(n for op, n in ops.items() if is_int64(op)),
        branches=sum(n for op, n in ops.items() if op.startswith("bra")),
    ), ops


def sass_listing(cubin):
    """[(label or None, instruction)] of the kernel body (the subroutines after `.weak` left out)."""
    listing = subprocess.run([NVDISASM, "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    body, label, out = listing.split(".weak")[0], None, []
    for line in body.splitlines():
        if re.match(r"^\.L_x_\d+:", line):
            label = line[:-1]
        elif (match := SASS_LINE.match(line)) and not match.group(2).startswith("NOP"):
            out.append((label, match.group(2)))
            label = None
    return out


def longest_path(listing):
    """Instructions on the longest path from the first instruction to an exit: each instruction
    falls through to the next (unless it is an unpredicated BRA, EXIT or RET) and a BRA also goes
    to its target. Backward branches (the trap loop after the last EXIT) are left out."""
    at = {label: i for i, (label, _) in enumerate(listing) if label}
    best = [0] * (len(listing) + 1)
    for i in range(len(listing) - 1, -1, -1):
        ins = listing[i][1]
        guarded = ins.startswith("@")
        op = ins.split()[1 if guarded else 0]
        successors = []
        if not (op.startswith(("BRA", "EXIT", "RET")) and not guarded):
            successors.append(i + 1)
        if op.startswith("BRA") and (target := SASS_TARGET.search(ins)) and at[target.group(1)] > i:
            successors.append(at[target.group(1)])
        best[i] = 1 + max((best[s] for s in successors), default=0)
    return best[0]


def assemble(ptx):
    """(registers, stack frame bytes, SASS listing) from ptxas and nvdisasm (None without it).
    A stack frame holds spilled registers and local arrays that did not become registers."""
    with tempfile.TemporaryDirectory() as tmp:
        src, cubin = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        report = subprocess.run([str(PTXAS), f"-arch=sm_{CC[0]}{CC[1]}", "-v", str(src), "-o", str(cubin)],
                                capture_output=True, text=True, check=True).stderr
        listing = sass_listing(cubin) if NVDISASM else None
    registers = int(re.search(r"Used (\d+) registers", report).group(1))
    stack = re.search(r"(\d+) bytes stack frame", report)
    return registers, int(stack.group(1)) if stack else 0, listing


def compile_ptx(fn, signature):
    ptx, _ = cuda.compile_ptx(fn, signature, cc=CC)
    return ptx


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", action="store_true", help="also print each kernel's PTX opcodes and counts")
    parser.add_argument("--dump", type=Path, help="also write each kernel's PTX into this folder")
    parser.add_argument("--all", action="store_true", help="also build every v3 specialization (registers)")
    args = parser.parse_args()

    print(f"head_dim {HEAD_DIM}, bf16 rows (strided views) and weights, float32 cache, fused rounding, "
          f"sm_{CC[0]}{CC[1]}")
    header = ("kernel", "PTX", "loads", "stores", "int64", "branch", "SASS", "path", "rows/warp", "path/row", "regs",
              "stack")
    print(f"{header[0]:24s}" + "".join(f"{h:>10s}" for h in header[1:]))
    kernels = list(v2_kernels()) + [(f"v3 {LAYOUT[n]}", *v3_kernel(n)) for n in (True, False)]
    for label, fn, signature, rows_per_warp in kernels:
        ptx = compile_ptx(fn, signature)
        counts, ops = ptx_counts(ptx)
        registers, stack, listing = assemble(ptx)
        sass, path = (len(listing), longest_path(listing)) if listing else ("-", "-")
        per_row = f"{path / rows_per_warp:.0f}" if listing else "-"
        cells = (*counts.values(), sass, path, rows_per_warp, per_row, registers, stack)
        print(f"{label:24s}" + "".join(f"{c:>10}" for c in cells))
        if args.ops:
            print("    " + ", ".join(f"{op} {n}" for op, n in ops.most_common()))
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{label.replace(' ', '_').replace('(', '').replace(')', '')}.ptx").write_text(ptx)

    if args.all:
        print("\nv3 specializations: registers (stack frame bytes)")
        for head_dim in (64, 128, 256, 512, 1024):
            cells = []
            for is_neox in (True, False):
                for hf in (False, True):
                    for weight in (m.WORD_TABLE, m.FLOAT_TABLE):
                        for cache in (m.WORD_TABLE, m.FLOAT_TABLE):
                            registers, stack, _ = assemble(compile_ptx(*v3_kernel(is_neox, hf, weight, cache,
                                                                                   head_dim)[:2]))
                            cells.append(f"{registers}({stack})")
            print(f"  head_dim {head_dim:4d}: " + " ".join(cells))
        print("  (per head_dim: neox then interleaved; fused then hf; bf16 then float32 weights; "
              "bf16 then float32 cache)")


if __name__ == "__main__":
    main()
