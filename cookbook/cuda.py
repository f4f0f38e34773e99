"""Lazy, cached loader of the CUDA C kernels in `kernels_cuda/`, and their Python entry points.

Nothing is built at import. The first call of an op builds `kernels_cuda/bindings/<op>.cu` with
`torch.utils.cpp_extension.load` for the GPU in use (its compute capability, C++20, light torch
headers, no pybind11: the library registers `torch.ops.cookbook.<op>` itself). Builds are cached
per configuration: the directory name holds the op, a hash of every kernel source, the torch and
CUDA versions and the GPU architecture, so an edit or another GPU builds anew and nothing stale
is loaded. A build lock left behind by a killed build would make every later build wait forever
(torch's FileBaton); a lock older than `STALE_LOCK_SECONDS` is removed with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
import warnings
from pathlib import Path

import torch

import kernels_cuda

KERNEL_DIR = Path(kernels_cuda.__file__).resolve().parent
STALE_LOCK_SECONDS = 600
CUDA_FLAGS = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
CXX_FLAGS = ["-O3", "-std=c++20"]


def sources() -> list[Path]:
    """Every file a build depends on (all of kernels_cuda/)."""
    return sorted(p for p in KERNEL_DIR.rglob("*") if p.suffix in (".cuh", ".cu", ".h"))


@functools.cache
def unavailable() -> str | None:
    """None when CUDA C kernels can be built and run here, else the reason."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch"
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME is None:
        return "nvcc (the CUDA toolkit) was not found: set CUDA_HOME"
    return None


def _arch() -> str:
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}"


def build_dir(op: str) -> Path:
    digest = hashlib.sha256()
    for path in sources():
        digest.update(path.relative_to(KERNEL_DIR).as_posix().encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(CUDA_FLAGS + CXX_FLAGS).encode())
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}-sm{_arch().replace('.', '')}"
    root = Path(os.environ.get("COOKBOOK_BUILD_DIR", Path.home() / ".cache" / "fused-norm-cookbook"))
    return root / tag / f"{op}-{digest.hexdigest()[:12]}"


def _clear_stale_lock(directory: Path) -> None:
    lock = directory / "lock"
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
        warnings.warn(f"removing a stale build lock left by a killed build: {lock}", RuntimeWarning, stacklevel=3)
        lock.unlink(missing_ok=True)


@functools.cache
def load(op: str) -> None:
    """Build (or reuse) and load the extension of `op`; registers `torch.ops.cookbook.<op>`."""
    reason = unavailable()
    if reason:
        raise RuntimeError(f"cannot build the CUDA C kernels of {op}: {reason}")
    from torch.utils import cpp_extension

    directory = build_dir(op)
    directory.mkdir(parents=True, exist_ok=True)
    _clear_stale_lock(directory)
    arch_before = os.environ.get("TORCH_CUDA_ARCH_LIST")
    os.environ["TORCH_CUDA_ARCH_LIST"] = _arch()  # build for this GPU only
    try:
        cpp_extension.load(
            name=f"cookbook_{op}",
            sources=[str(KERNEL_DIR / "bindings" / f"{op}.cu")],
            extra_include_paths=[str(KERNEL_DIR)],
            extra_cflags=CXX_FLAGS,
            extra_cuda_cflags=CUDA_FLAGS,
            build_directory=str(directory),
            is_python_module=False,
            verbose=os.environ.get("COOKBOOK_VERBOSE_BUILD", "0") == "1",
        )
    finally:
        if arch_before is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_before
    _register_fakes(op)


# The torch ops a binding defines, where they are not just `cookbook::<op>`.
LIBRARY_OPS = {"tp_qk_norm": ("tp_qk_norm_sum_sq", "tp_qk_norm_apply", "tp_qk_norm_fused")}


def _register_fakes(op: str) -> None:
    """Fake (meta) kernels of the binding's `torch.ops.cookbook.*`: by the house convention every
    CUDA C op mutates its tensor arguments in place and returns nothing."""

    def fake(*args, **kwargs):
        return None

    for name in LIBRARY_OPS.get(op, (op,)):
        torch.library.register_fake(f"cookbook::{name}", fake)


# --------------------------------------------------------------------------------------------
# Entry points with the registry's calling convention (the op's checked arguments, in place).
# One small function per op; the registry binds `version`.
# --------------------------------------------------------------------------------------------
def qk_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding, *, version):
    load("qk_norm")
    torch.ops.cookbook.qk_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding == "hf", version)


def cross_head_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding, *, version):
    load("cross_head_norm")
    torch.ops.cookbook.cross_head_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding == "hf", version)


def qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox, rope_dim,
                 position_offset, *, version):
    load("qk_norm_rope")
    torch.ops.cookbook.qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, is_neox,
                                    rope_dim, position_offset, rounding == "hf", version)


def tp_qk_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding, group, *, version):
    """v1: sum-of-squares kernel -> NCCL all-reduce of the [T, 2] sums -> apply kernel (three
    launches); v2 on: one fused kernel that exchanges the sums through the group's symmetric-memory
    workspace (`cookbook.tp_workspace`)."""
    from cookbook.ops.tp_qk_norm import NUM_TENSORS, all_reduce_sum, world_of

    load("tp_qk_norm")
    hf = rounding == "hf"
    if version == 1:
        tp = world_of(group)[1]
        sum_sq = torch.empty((q.shape[0], NUM_TENSORS), dtype=torch.float32, device=q.device)
        torch.ops.cookbook.tp_qk_norm_sum_sq(q, k, sum_sq)
        all_reduce_sum(sum_sq, group)
        torch.ops.cookbook.tp_qk_norm_apply(q, k, q_weight, k_weight, sum_sq, eps, weight_offset,
                                            q.shape[1] * tp, k.shape[1] * tp, hf)
        return
    from cookbook import tp_workspace

    ws = tp_workspace.get(group)
    torch.ops.cookbook.tp_qk_norm_fused(q, k, q_weight, k_weight, ws.counters, ws.peer_buffers, ws.status.data_ptr(),
                                        ws.rank, ws.capacity, eps, weight_offset, hf, version)
