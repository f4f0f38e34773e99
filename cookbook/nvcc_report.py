"""Compile the torch-free kernel headers with nvcc alone and read the compiler's resource report.

Needs nvcc, not a GPU: CI runs it to prove every kernel compiles, and the docs quote its
registers / spills per kernel. Each op header `kernels_cuda/<op>.cuh` defines
`cookbook::<op>::launch`; taking its address instantiates every kernel the launcher can reach.

    python -m cookbook.nvcc_report qk_norm      # prints registers and spills per kernel
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import kernels_cuda

KERNEL_DIR = Path(kernels_cuda.__file__).resolve().parent
DEFAULT_ARCH = "sm_90"  # Hopper (H100/H200), the GPUs the cookbook is measured on
NVCC_FLAGS = ["-std=c++20", "-O3", "--expt-relaxed-constexpr"]

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


@dataclass(frozen=True)
class KernelResources:
    kernel: str  # demangled name (the mangled one where no demangler is installed)
    registers: int
    spill_bytes: int
    mangled: str = ""  # the same on every machine, whatever demangler it has


def nvcc() -> str | None:
    return shutil.which("nvcc")


def _demangle(names: list[str]) -> list[str]:
    # cu++filt ships beside nvcc in the CUDA toolkit (which is not always on PATH).
    beside_nvcc = str(Path(os.path.realpath(nvcc() or "nvcc")).parent)
    filt = shutil.which("cu++filt") or shutil.which("cu++filt", path=beside_nvcc) or shutil.which("c++filt")
    if not filt:
        return names
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return out.strip().splitlines()


# The host launchers a header's binding calls (taking their address instantiates every kernel);
# `launch` unless listed.
ENTRY_POINTS = {"tp_qk_norm": ("sum_sq", "apply", "fused")}


def compile_header(op: str, arch: str = DEFAULT_ARCH) -> list[KernelResources]:
    """Compile every kernel of `kernels_cuda/<op>.cuh`; raise with nvcc's output on failure."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / f"{op}_all.cu"
        keep = "".join(f"auto const keep_{entry} = &cookbook::{op}::{entry};\n" for entry in ENTRY_POINTS.get(op, ("launch",)))
        unit.write_text(f'#include "{op}.cuh"\n{keep}')
        cmd = [compiler, *NVCC_FLAGS, f"-arch={arch}", f"-I{KERNEL_DIR}", "-Xptxas", "-v", "-c", str(unit),
               "-o", str(Path(tmp) / "unit.o")]
        run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"nvcc failed on {op}.cuh:\n{run.stderr}")
    return parse_ptxas(run.stderr)


def parse_ptxas(log: str) -> list[KernelResources]:
    mangled, regs, spills = [], {}, {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = m.group(1)
            mangled.append(current)
        elif current and (m := _SPILL.search(line)):
            spills[current] = int(m.group(1)) + int(m.group(2))
        elif current and (m := _REGS.search(line)):
            regs[current] = int(m.group(1))
    names = _demangle(mangled)
    return [KernelResources(name, regs.get(raw, -1), spills.get(raw, 0), raw) for name, raw in zip(names, mangled)]


def main(argv=None) -> int:
    ops = (argv if argv is not None else sys.argv[1:]) or ["qk_norm"]
    for op in ops:
        print(f"{op}.cuh ({DEFAULT_ARCH}):")
        for k in compile_header(op):
            print(f"  {k.registers:4d} registers  {k.spill_bytes:4d} spill bytes  {k.kernel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
