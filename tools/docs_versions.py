#!/usr/bin/env python3
"""Print the versions table of an op's docs page, from the registry and nvcc's resource report.

    python tools/docs_versions.py qk_norm        # paste the output into docs/qk_norm.md

One row per registered implementation (name, level, version, lead); CUDA C rows add the
registers and spill bytes ptxas reports for the bf16 kernels (fused rounding; for the head_dim
specialized kernels, head_dim 128) when nvcc is on PATH.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cookbook import nvcc_report, registry  # noqa: E402

HEAD_DIM = "128"


def cuda_registers(op: str) -> dict[int, str]:
    """{version: "R regs, S B spill"} for the bf16 fused-rounding kernels, or {} without nvcc."""
    if nvcc_report.nvcc() is None:
        return {}
    # Extra template arguments after the rounding flag (qk_norm's row index type) are allowed;
    # a version that reuses an earlier version's kernel (qk_norm v4) has no row of its own.
    name = re.compile(rf"{op}_v(\d+)_kernel<__nv_bfloat16, (?:(\d+), )?false(?:, long)?>")
    found = {}
    for kernel in nvcc_report.compile_header(op):
        m = name.search(kernel.kernel)
        if m and m.group(2) in (None, HEAD_DIM):
            found[int(m.group(1))] = f"{kernel.registers} regs, {kernel.spill_bytes} B spill"
    return found


def table(op: str) -> str:
    registers = cuda_registers(op)
    note = (f"registers: ptxas for {nvcc_report.DEFAULT_ARCH}, bf16, fused rounding, head_dim {HEAD_DIM} where specialized"
            if registers else "registers: nvcc not found, not reported")
    lines = [f"| implementation | level | version | what changed, and which bottleneck it removes | registers ({nvcc_report.DEFAULT_ARCH}) |",
             "|---|---|---|---|---|"]
    for impl in registry.implementations(op):
        regs = registers.get(impl.version, "an earlier version's kernel") if impl.level == "cuda" and registers else "-"
        lines.append(f"| `{impl.name}` | {impl.level} | {impl.version or '-'} | {impl.lead} | {regs} |")
    lines += ["", f"({note}; `backend=\"cuda\"` runs `{registry.latest(op, 'cuda').name}`.)"]
    return "\n".join(lines)


def main(argv=None) -> int:
    ops = (argv if argv is not None else sys.argv[1:]) or ["qk_norm"]
    for op in ops:
        print(table(op))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
