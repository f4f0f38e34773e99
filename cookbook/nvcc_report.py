"""Compile the torch-free kernels with nvcc alone and read the compiler's resource report.

Needs nvcc, not a GPU: CI runs it to prove every kernel compiles, and the docs quote its
registers / spills per kernel.

* Ops in the ladder layout (qk_norm): each extension (a rung, or the tuned kernel) compiles as
  one nvcc unit holding all its launchers (`compile_extension`), and its binding with the host
  compiler against torch's headers (`compile_extension_binding`): the units the build compiles.
* Ops in the older layout: the header `kernels_cuda/<op>.cuh` defines `cookbook::<op>::launch`;
  taking its address instantiates every kernel the launcher can reach (`compile_header`), and
  the binding `bindings/<op>.cu` compiles with nvcc (`compile_binding`).

    python -m cookbook.nvcc_report qk_norm      # prints registers and spills per kernel
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kernels_cuda import KERNEL_DIR, Extension
DEFAULT_ARCH = "sm_90"  # Hopper (H100/H200), the GPUs the cookbook is measured on
NVCC_FLAGS = ["-std=c++20", "-O3", "--expt-relaxed-constexpr"]

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_SHARED = re.compile(r"(\d+) bytes smem")

# The compiles run on a worker thread during the test session (tests/nvcc_jobs.py) while the
# main thread may set and unset environment variables (monkeypatch, the gloo pool). A child
# started with the inherited environment is exec'd with the C `environ` that putenv may be
# rewriting at that moment: exec then fails with EFAULT ("Bad address"), which failed a CI run.
# So every tool here is started with a copy of the environment taken when this module is
# imported, which no other thread can change.
_ENVIRONMENT = dict(os.environ)


def _run_tool(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run with this module's copy of the environment (see _ENVIRONMENT)."""
    return subprocess.run(cmd, env=_ENVIRONMENT, capture_output=True, text=True, **kwargs)


@dataclass(frozen=True)
class KernelResources:
    kernel: str  # demangled name (the mangled one where no demangler is installed)
    registers: int
    spill_bytes: int
    mangled: str = ""  # the same on every machine, whatever demangler it has
    shared_bytes: int = 0  # static shared memory per block


def nvcc() -> str | None:
    return shutil.which("nvcc")


def _demangle(names: list[str]) -> list[str]:
    # cu++filt ships beside nvcc in the CUDA toolkit (which is not always on PATH).
    beside_nvcc = str(Path(os.path.realpath(nvcc() or "nvcc")).parent)
    filt = shutil.which("cu++filt") or shutil.which("cu++filt", path=beside_nvcc) or shutil.which("c++filt")
    if not filt:
        return names
    out = _run_tool([filt], input="\n".join(names), check=True).stdout
    return out.strip().splitlines()


# The host launchers a header's binding calls (taking their address instantiates every kernel);
# `launch` unless listed.
ENTRY_POINTS: dict[str, tuple[str, ...]] = {}  # older layout: the entry points a header unit keeps


def _report_cache(op: str, arch: str, unit_text: str, compiler: str, kernel_dir: Path | None = None) -> Path:
    """Where ptxas's report for this exact compile is kept: keyed by the unit, every header under
    kernels_cuda/ (or `kernel_dir`), the flags, the arch and the nvcc binary, so an edit anywhere
    means a new key. A header compiles in minutes on a small CI machine, and the tests and
    notebooks of one run ask for the same report several times."""
    kernel_dir = KERNEL_DIR if kernel_dir is None else kernel_dir
    digest = hashlib.sha256()
    stat = os.stat(os.path.realpath(compiler))
    for part in (unit_text, arch, " ".join(NVCC_FLAGS), os.path.realpath(compiler), str(stat.st_size), str(stat.st_mtime_ns)):
        digest.update(part.encode() + b"\0")
    for header in sorted(p for p in kernel_dir.rglob("*") if p.suffix in (".cuh", ".h")):
        digest.update(str(header.relative_to(kernel_dir)).encode() + b"\0" + header.read_bytes() + b"\0")
    root = Path(os.environ.get("COOKBOOK_BUILD_DIR", Path.home() / ".cache" / "fused-norm-cookbook"))
    return root / "ptxas_reports" / f"{op}-{arch}-{digest.hexdigest()[:24]}.log"


def extensions(op: str | None = None) -> dict[str, Extension]:
    """{name: extension} of every registered implementation in the ladder layout (of `op`)."""
    from cookbook import registry

    found = {}
    for name in registry.ops() if op is None else [op]:
        for impl in registry.implementations(name):
            if impl.extension is not None:
                found[impl.extension.name] = impl.extension
    return found


def compile_header(op: str, arch: str = DEFAULT_ARCH) -> list[KernelResources]:
    """Compile every kernel of `kernels_cuda/<op>.cuh` (older layout); raise with nvcc's output on
    failure."""
    return parse_ptxas(ptxas_log(op, arch))


def compile_extension(name: str, arch: str = DEFAULT_ARCH) -> list[KernelResources]:
    """Compile every kernel of the extension `name` (``qk_norm_v3``): its launchers of every dtype
    and rounding in one nvcc unit; raise with nvcc's output on failure."""
    return parse_ptxas(ptxas_log(name, arch))


def _unit_of(key: str) -> str:
    """The unit `compile_extension` (an extension's name) or `compile_header` (an op) compiles."""
    ext = extensions().get(key)
    if ext is not None:
        return "".join(ext.kernel_units().values())
    keep = "".join(f"auto const keep_{entry} = &cookbook::{key}::{entry};\n" for entry in ENTRY_POINTS.get(key, ("launch",)))
    return f'#include "{key}.cuh"\n{keep}'


def report_is_cached(key: str, arch: str = DEFAULT_ARCH) -> bool:
    """Whether ptxas's report for `key` (an extension or an op) is already cached: asking for it is then free."""
    compiler = nvcc()
    return compiler is not None and _report_cache(key, arch, _unit_of(key), compiler).is_file()


def ptxas_log(key: str, arch: str = DEFAULT_ARCH) -> str:
    """ptxas's whole report (registers, spills, shared memory per kernel) for `key`: an extension
    (``qk_norm_v3``) or an op in the older layout (``cross_head_norm``); cached."""
    return _compile_unit(key, _unit_of(key), arch)


def _compile_unit(key: str, unit_text: str, arch: str) -> str:
    """Compile `unit_text` with nvcc and return ptxas's report. The report of a successful compile
    is reused while nothing it depends on changes (_report_cache)."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found on PATH")
    cache = _report_cache(key, arch, unit_text, compiler)
    if cache.is_file():
        return cache.read_text()
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / f"{key}_all.cu"
        unit.write_text(unit_text)
        cmd = [compiler, *NVCC_FLAGS, f"-arch={arch}", f"-I{KERNEL_DIR}", "-Xptxas", "-v", "-c", str(unit),
               "-o", str(Path(tmp) / "unit.o")]
        run = _run_tool(cmd)
    if run.returncode != 0:
        raise RuntimeError(f"nvcc failed on {key}:\n{run.stderr}")
    try:  # another process may write the same report: write aside, then rename into place
        cache.parent.mkdir(parents=True, exist_ok=True)
        aside = cache.with_suffix(f".{os.getpid()}.tmp")
        aside.write_text(run.stderr)
        aside.replace(cache)
    except OSError:
        pass  # a read-only cache directory only costs the next call a compile
    return run.stderr


def torch_includes(scratch: Path) -> list[Path]:
    """Torch's C++ include folders, for compiling a binding with nvcc alone. A CPU build of torch
    ships the c10/cuda headers without the generated `cuda_cmake_macros.h`; it only holds export
    macros, so a stand-in written under `scratch` is enough to compile (not link) a binding."""
    import torch

    root = Path(torch.__file__).parent / "include"
    paths = [root, root / "torch" / "csrc" / "api" / "include"]
    if not (root / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        stub = scratch / "c10" / "cuda" / "impl"
        stub.mkdir(parents=True, exist_ok=True)
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        paths.append(scratch)
    return paths


def compile_binding(op: str, arch: str = DEFAULT_ARCH, unit_text: str | None = None) -> None:
    """Compile (not link) the torch binding `kernels_cuda/bindings/<op>.cu` with nvcc alone, as CI
    does without a GPU; raise with nvcc's output on failure."""
    import sysconfig

    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        source = KERNEL_DIR / "bindings" / f"{op}.cu"
        if unit_text is not None:  # a unit that includes the binding
            source = Path(tmp) / "binding.cu"
            source.write_text(unit_text)
        includes = [KERNEL_DIR, *torch_includes(Path(tmp)), sysconfig.get_paths()["include"]]
        cmd = [compiler, *NVCC_FLAGS, f"-arch={arch}", *(f"-I{p}" for p in includes), "-c",
               str(source), "-o", str(Path(tmp) / "binding.o")]
        run = _run_tool(cmd)
    if run.returncode != 0:
        raise RuntimeError(f"nvcc failed on bindings/{op}.cu{' (the tuned unit)' if unit_text else ''}:\n{run.stderr[-4000:]}")


_NVCC_INCLUDES = re.compile(r'^#\$ (?:INCLUDES|SYSTEM_INCLUDES)=(.*)$', re.MULTILINE)


def cuda_includes() -> list[str]:
    """The include folders nvcc passes to the host compiler (cuda_runtime.h among them), as its
    dry run prints them: right wherever the toolkit lives, wrapper scripts included."""
    run = _run_tool([nvcc(), "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull])
    folders = []
    for value in _NVCC_INCLUDES.findall(run.stderr + run.stdout):
        folders += [word.removeprefix("-I") for word in shlex.split(value) if not word.startswith("-isystem")]
    return folders


def compile_extension_binding(name: str) -> None:
    """Compile (not link) the host binding unit of extension `name` with the host compiler against
    torch's headers, as the build does; raise with the compiler's output on failure."""
    import sysconfig

    ext = extensions()[name]
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None or nvcc() is None:
        raise RuntimeError("a host C++ compiler and nvcc (for the CUDA headers) are needed")
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "binding.cpp"
        unit.write_text(ext.binding_unit())
        includes = [KERNEL_DIR, *torch_includes(Path(tmp)), sysconfig.get_paths()["include"], *cuda_includes()]
        cmd = [compiler, "-std=c++20", "-O0", "-fPIC", *(f"-I{p}" for p in includes), "-c", str(unit),
               "-o", str(Path(tmp) / "binding.o")]
        run = _run_tool(cmd)
    if run.returncode != 0:
        raise RuntimeError(f"the host compiler failed on the binding of {name}:\n{run.stderr[-4000:]}")


def parse_ptxas(log: str) -> list[KernelResources]:
    mangled, regs, spills, shared = [], {}, {}, {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            current = m.group(1)
            mangled.append(current)
        elif current and (m := _SPILL.search(line)):
            spills[current] = int(m.group(1)) + int(m.group(2))
        elif current and (m := _REGS.search(line)):
            regs[current] = int(m.group(1))
            if s := _SHARED.search(line):
                shared[current] = int(s.group(1))
    names = _demangle(mangled)
    return [KernelResources(name, regs.get(raw, -1), spills.get(raw, 0), raw, shared.get(raw, 0))
            for name, raw in zip(names, mangled)]


def main(argv=None) -> int:
    ops = (argv if argv is not None else sys.argv[1:]) or ["qk_norm"]
    for op in ops:
        reports = {name: compile_extension(name) for name in extensions(op)} or {f"{op}.cuh": compile_header(op)}
        for unit, kernels in reports.items():
            print(f"{unit} ({DEFAULT_ARCH}):")
            for k in kernels:
                print(f"  {k.registers:4d} registers  {k.spill_bytes:4d} spill bytes  {k.kernel}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
