"""SGLang's fused tensor-parallel QK norm, a peer of `tp_qk_norm` in the TP benchmark.

``fused_parallel_qknorm`` (``sglang.jit_kernel.all_reduce``) normalizes each rank's column shards
of q and k over the full widths in one kernel: one CTA per token in a persistent walk; each rank
stores a float pair (its q and k sums of squares) into every peer's push buffer of SGLang's JIT
custom all-reduce (v2) and polls its own; a sum that is not zero has arrived, and the reader
clears it. Its JIT module is built per dtype, world size and FULL widths (TVM-FFI and nvcc, on
first use).

Set up here without SGLang's serving stack, as its own kernel benchmark sets it up: the custom
all-reduce object of `get_custom_all_reduce_cls()` with no pull buffer, a push buffer of 8 bytes per
token of the largest call, and as many push blocks as the kernel keeps resident (SMs x its
occupancy); the objects' IPC handles are exchanged over a gloo group of the same ranks. SGLang's
own checks (the NVLink probe that imports the whole framework) are skipped: the benchmark only
runs it on one node whose GPUs reach each other.

Differences from the contract, each within the benchmark's agreement check: eps enters each
rank's partial sum (as eps / world), so the row's scale is rsqrt(mean(x^2) + eps / full width)
instead of rsqrt(mean(x^2) + eps); weights must be of the activations' dtype; weight_offset 0 and
the fused rounding order only; 16-byte aligned rows and weights; world a power of two.
"""

from __future__ import annotations

import functools
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from cookbook.peers import guard, sglang_jit

NAME = "sglang_fused_parallel_qknorm"
MODULES = ("sglang.jit_kernel.all_reduce",)
PUSH_BYTES_PER_TOKEN = 8  # one float pair per token, as SGLang's benchmark sizes it
PUSH_ALIGNMENT = 128  # its buffers' sizes are multiples of 128 bytes
HALF_DTYPES = (torch.float16, torch.bfloat16)


def why_not(dtype, world: int, q_shard_width: int, k_shard_width: int, weight_dtype) -> str | None:
    """Why the kernel cannot run this call (its wrapper's and its template's checks), or None."""
    if dtype not in HALF_DTYPES:
        return f"{dtype}: the kernel is built for float16 and bfloat16 only"
    if weight_dtype != dtype:
        return f"weights in {weight_dtype}: the kernel takes weights of the activations' dtype only"
    if world < 2 or world & (world - 1):
        return f"a group of {world}: the kernel is built for a power-of-two world of 2 or more"
    pair = 16 // torch.empty((), dtype=dtype).element_size()  # elements per thread's 16 bytes
    if q_shard_width % (pair * 32) or k_shard_width % pair:
        return (f"shards of {q_shard_width} (q) and {k_shard_width} (k): the kernel needs q shards of whole warps of "
                f"{pair}-element vectors and k shards of whole vectors")
    if (q_shard_width + k_shard_width) // pair > 1024:
        return "a row pair wider than 1024 vectors: one thread per vector, at most 1024 per block"
    return None


def _driver_library_on_link_path() -> None:
    """SGLang's JIT modules link with -lcuda; where the driver ships only libcuda.so.1, put a
    libcuda.so link to it on the linker's path (LIBRARY_PATH)."""
    for folder in os.environ.get("LIBRARY_PATH", "").split(":"):
        if folder and (Path(folder) / "libcuda.so").exists():
            return
    candidates = ["/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64", "/usr/local/cuda/compat",
                  "/usr/local/cuda/lib64/stubs"]
    for folder in candidates:
        if (Path(folder) / "libcuda.so").exists():
            os.environ["LIBRARY_PATH"] = f"{folder}:{os.environ.get('LIBRARY_PATH', '')}".rstrip(":")
            return
    for folder in candidates:
        real = Path(folder) / "libcuda.so.1"
        if real.exists():
            link_dir = Path(tempfile.mkdtemp(prefix="cookbook-libcuda-"))
            (link_dir / "libcuda.so").symlink_to(real)
            os.environ["LIBRARY_PATH"] = f"{link_dir}:{os.environ.get('LIBRARY_PATH', '')}".rstrip(":")
            return


@functools.cache
def load() -> tuple[str, object]:
    """("sglang <version>", its all_reduce module) through the shim of `cookbook.peers.sglang_jit`;
    PeerUnavailable where SGLang is not installed or the module does not import."""
    package, _ = sglang_jit.load()
    os.environ.setdefault("SGLANG_SKIP_P2P_CHECK", "1")
    _driver_library_on_link_path()
    module = guard.first_module(MODULES)
    for name in ("fused_parallel_qknorm", "get_fused_parallel_qknorm_max_occupancy", "get_custom_all_reduce_cls"):
        if not hasattr(module, name):
            raise guard.PeerUnavailable(f"{package} has no {name} in {module.__name__}")
    return package, module


def _log(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"[{NAME}] {message}", file=sys.stderr, flush=True)


@functools.cache
def _cpu_group():
    """A gloo group of every rank, for exchanging the IPC handles (collective: every rank calls it
    at the same point)."""
    return dist.new_group(backend="gloo")


@functools.cache
def _module_built(dtype, world: int, q_width: int, k_width: int) -> int:
    """Build the kernel's JIT module for these FULL widths (rank 0 first, so that the ranks do not
    compile the same files at once) and return its resident blocks per SM."""
    _, module = load()
    failed = ""
    if dist.get_rank() == 0:
        _log(f"building the JIT module ({dtype}, world {world}, widths {q_width}/{k_width})")
        try:
            module.get_fused_parallel_qknorm_max_occupancy(dtype, world, q_width, k_width)
        except Exception as error:  # noqa: BLE001 - every rank must learn it, or the others would wait
            failed = f"its JIT build failed: {type(error).__name__}: {str(error)[-800:]}"
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, failed, group=_cpu_group())
    if everyone[0]:
        raise guard.PeerUnavailable(everyone[0])
    return int(module.get_fused_parallel_qknorm_max_occupancy(dtype, world, q_width, k_width))


@functools.cache
def _all_reduce_object(world: int, max_tokens: int, push_blocks: int):
    """SGLang's custom all-reduce object, its push buffers mapped on every rank (collective)."""
    _, module = load()
    rank = dist.get_rank()
    push_bytes = -(-PUSH_BYTES_PER_TOKEN * max_tokens // PUSH_ALIGNMENT) * PUSH_ALIGNMENT
    _log(f"custom all-reduce: push buffer {push_bytes} bytes, {push_blocks} push blocks")
    obj = module.get_custom_all_reduce_cls()(rank, world, 0, push_bytes, 1, max_push_blocks=push_blocks)
    handle = torch.tensor([obj.share_storage()], dtype=torch.int64)  # as SGLang's own setup shares it
    handles = [torch.empty_like(handle) for _ in range(world)]
    dist.all_gather(handles, handle, group=_cpu_group())
    obj.post_init([h.tolist()[0] for h in handles])
    dist.barrier(group=_cpu_group())
    return obj


def kernel(dtype, world: int, q_width: int, k_width: int, max_tokens: int):
    """fn(q_shard, k_shard, q_weight_shard, k_weight_shard, eps) running SGLang's kernel on this
    rank's shards (FULL widths `q_width`, `k_width`; calls of at most `max_tokens` tokens). Collective
    on first use; raises PeerUnavailable (on every rank alike) where it cannot run."""
    reason = why_not(dtype, world, q_width // world, k_width // world, dtype)
    if reason:
        raise guard.PeerUnavailable(reason)
    _, module = load()
    occupancy = _module_built(dtype, world, q_width, k_width)
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    obj = _all_reduce_object(world, max_tokens, sms * occupancy)
    run = module.fused_parallel_qknorm

    def fused_parallel_qknorm(q, k, q_weight, k_weight, eps):
        run(obj, q, k, q_weight, k_weight, eps)

    return fused_parallel_qknorm


def package() -> str:
    """"sglang <version>" where installed (the row's package), else what is missing."""
    try:
        return load()[0]
    except guard.PeerUnavailable as error:
        return str(error)

