"""Builds and loads the CUDA C kernels in `kernels_cuda/`, lazily, in parallel, cached.

Nothing is built at import. An op in the ladder layout (qk_norm, cross_head_norm, qk_norm_rope, qk_norm_rope_cache) builds one extension
per kernel file (`kernels_cuda.Extension`): each rung, and the tuned kernel, is its own small library,
registering `torch.ops.cookbook.<op>_<stem>`, built from a host binding unit and one nvcc unit per
dtype and rounding, which ninja compiles in parallel. The first `backend="auto"` call builds only
the tuned kernel; the benchmark builds every extension it needs at once (`build`), in parallel.

The other ops still build one extension from `kernels_cuda/bindings/<op>.cu` (`load(op)`).

Builds are cached per configuration: the directory name holds the extension, a hash of every
source it includes, the flags, the torch and CUDA versions and the GPU architecture, so an edit or
another GPU builds anew and nothing stale is loaded. A build holds an OS file lock on its
directory; the OS releases it when the process ends, however it ends, so a killed build never
makes a later one wait: the next builder takes the lock at once and clears what the killed one
left (torch's own lock file among it).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels_cuda import KERNEL_DIR, Extension

CUDA_FLAGS = ["-O3", "-std=c++20", "--expt-relaxed-constexpr", "-lineinfo"]
CXX_FLAGS = ["-O3", "-std=c++20"]
TORCH_BATON = "lock"  # the lock file torch's own build leaves in a build directory while it runs


@dataclass(frozen=True)
class BuildRecord:
    """How an extension came to be loaded in this process."""

    name: str
    seconds: float  # wall time of the build (or of loading it from the cache)
    cached: bool  # loaded from an earlier build


BUILDS: dict[str, BuildRecord] = {}  # extension name -> record, in load order (the bench reports it)
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


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


def _build_root() -> Path:
    root = Path(os.environ.get("COOKBOOK_BUILD_DIR", Path.home() / ".cache" / "fused-norm-cookbook"))
    return root / f"torch{torch.__version__}-cuda{torch.version.cuda}-sm{_arch().replace('.', '')}"


def _digest(paths, *texts) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.relative_to(KERNEL_DIR).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    for text in (*texts, " ".join(CUDA_FLAGS + CXX_FLAGS)):
        digest.update(text.encode() + b"\0")
    return digest.hexdigest()[:12]


def extension_dir(ext: Extension) -> Path:
    units = "".join(ext.kernel_units().values()) + ext.binding_unit()
    return _build_root() / f"{ext.name}-{_digest(ext.dependencies(), units)}"


def op_dir(op: str) -> Path:
    """The build directory of an op still built as one extension (`load`)."""
    sources = sorted(p for p in KERNEL_DIR.rglob("*") if p.suffix in (".cuh", ".cu", ".h"))
    return _build_root() / f"{op}-{_digest(sources)}"


@contextmanager
def _build_lock(directory: Path):
    """Hold the OS lock of `directory` (waiting for a live builder, never for a dead one), then
    clear the lock file a killed torch build may have left."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory.with_name(directory.name + ".lock"), "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            owner = handle.read().strip() or "another process"
            print(f"waiting for {owner}, which is building {directory.name} ...", flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        (directory / TORCH_BATON).unlink(missing_ok=True)  # only a dead builder leaves it now
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextmanager
def _build_environment(jobs: int | None):
    """TORCH_CUDA_ARCH_LIST for this GPU only and, for parallel builds, MAX_JOBS (ninja's
    parallel compiles), set for the builds and restored after. Set once around all the builds of
    one call, never while another of its threads starts a compiler."""
    wanted = {"TORCH_CUDA_ARCH_LIST": _arch()}
    if jobs is not None and "MAX_JOBS" not in os.environ:
        wanted["MAX_JOBS"] = str(jobs)
    before = {key: os.environ.get(key) for key in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _compile(name: str, sources: list[str], directory: Path) -> BuildRecord:
    """Build (or load the cached build of) one extension in `directory`; registers its ops."""
    from torch.utils import cpp_extension

    start = time.perf_counter()
    cached = (directory / f"{name}.so").exists()
    with _build_lock(directory):
        cpp_extension.load(
            name=name,
            sources=sources,
            extra_include_paths=[str(KERNEL_DIR)],
            extra_cflags=CXX_FLAGS,
            extra_cuda_cflags=CUDA_FLAGS,
            build_directory=str(directory),
            is_python_module=False,
            verbose=os.environ.get("COOKBOOK_VERBOSE_BUILD", "0") == "1",
        )
    return BuildRecord(name, time.perf_counter() - start, cached)


def _write_units(ext: Extension, directory: Path) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    units = {"binding.cpp": ext.binding_unit(), **ext.kernel_units()}
    for file_name, text in units.items():
        path = directory / file_name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
    return [str(directory / file_name) for file_name in units]


def _lock_of(name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(name, threading.Lock())


def _load(ext: Extension) -> BuildRecord:
    """Build and load `ext` once per process (threads wait for each other), registering its fake."""
    with _lock_of(ext.name):
        if ext.name in BUILDS:
            return BUILDS[ext.name]
        reason = unavailable()
        if reason:
            raise RuntimeError(f"cannot build the CUDA C kernels of {ext.name}: {reason}")
        directory = extension_dir(ext)
        record = _compile(f"cookbook_{ext.name}", _write_units(ext, directory), directory)
        record = BuildRecord(ext.name, record.seconds, record.cached)
        _register_fakes(tuple(f"{ext.name}_{step}" for step in ext.tp_steps) if ext.op == "tp_qk_norm" else (ext.name,))
        how = "loaded from the cache" if record.cached else "built"
        print(f"{ext.name}: {how} in {record.seconds:.1f} s", flush=True)
        BUILDS[ext.name] = record
        return record


def load_extension(ext: Extension):
    """The op `torch.ops.cookbook.<ext.name>`, built and loaded on first use."""
    if ext.name not in BUILDS:
        with _build_environment(jobs=None):
            _load(ext)
    return getattr(torch.ops.cookbook, ext.name)


def build(extensions) -> dict[str, BuildRecord | Exception]:
    """Build and load `extensions` in parallel (each also compiles its units in parallel): the
    whole ladder of an op in about the time of its slowest kernel. {name: record, or the error}."""
    extensions = list(dict.fromkeys(extensions))
    pending = [ext for ext in extensions if ext.name not in BUILDS]
    results: dict[str, BuildRecord | Exception] = {ext.name: BUILDS[ext.name] for ext in extensions if ext.name in BUILDS}
    if not pending:
        return results
    # Every ninja may use every core: the units of all extensions share them, and the longest
    # (the tuned kernel's) start as early as the shortest.
    with _build_environment(jobs=os.cpu_count() or 1), ThreadPoolExecutor(max_workers=len(pending)) as pool:
        futures = {ext.name: pool.submit(_load, ext) for ext in pending}
        for name, future in futures.items():
            try:
                results[name] = future.result()
            except Exception as error:  # reported per extension: the others still load
                results[name] = error
    return results


@functools.cache
def load(op: str) -> None:
    """Build (or reuse) and load the one extension of an op in the older layout, from
    `kernels_cuda/bindings/<op>.cu`; registers `torch.ops.cookbook.<op>` (and its helpers)."""
    reason = unavailable()
    if reason:
        raise RuntimeError(f"cannot build the CUDA C kernels of {op}: {reason}")
    with _build_environment(jobs=None):
        record = _compile(f"cookbook_{op}", [str(KERNEL_DIR / "bindings" / f"{op}.cu")], op_dir(op))
    _register_fakes(LIBRARY_OPS.get(op, (op,)))
    print(f"{op}: {'loaded from the cache' if record.cached else 'built'} in {record.seconds:.1f} s", flush=True)
    BUILDS[op] = BuildRecord(op, record.seconds, record.cached)


LIBRARY_OPS: dict[str, tuple[str, ...]] = {}  # ops of the older layout whose torch ops are not just cookbook::<op>


def _register_fakes(names) -> None:
    """Fake (meta) kernels of the extension's `torch.ops.cookbook.*`: by the house convention
    every CUDA C op mutates its tensor arguments in place and returns nothing."""

    def fake(*args, **kwargs):
        return None

    for name in names:
        torch.library.register_fake(f"cookbook::{name}", fake)


# --------------------------------------------------------------------------------------------
# Entry points with the registry's calling convention (the op's checked arguments, in place).
# The registry binds `extension` (ladder layout) or `version` (older layout).
# --------------------------------------------------------------------------------------------
def qk_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding, *, extension: Extension):
    load_extension(extension)(q, k, q_weight, k_weight, eps, weight_offset, rounding == "hf")


def cross_head_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding, *, extension: Extension):
    load_extension(extension)(q, k, q_weight, k_weight, eps, weight_offset, rounding == "hf")


def qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox, rope_dim,
                 position_offset, *, extension: Extension):
    load_extension(extension)(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, is_neox, rope_dim,
                              position_offset, rounding == "hf")


def qk_norm_rope_cache(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale,
                       v_scale, eps, weight_offset, rounding, is_neox, rope_dim, *, extension: Extension):
    load_extension(extension)(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
                              k_scale, v_scale, eps, weight_offset, is_neox, rope_dim, rounding == "hf")


def tp_qk_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding, group, *, extension: Extension):
    """Rung 1 (and the tuned kernel where the fused path cannot run, `nccl=True` below): a
    sum-of-squares kernel -> NCCL all-reduce of the [T, 2] sums -> apply kernel (three launches);
    rung 2 on and the tuned kernel: one fused kernel that exchanges the sums through the group's
    symmetric-memory workspace (`cookbook.tp_workspace`)."""
    if extension.stem == "v1":
        return tp_qk_norm_nccl(q, k, q_weight, k_weight, eps, weight_offset, rounding, group, extension=extension)
    from cookbook import tp_workspace

    ops = TpOps(extension)
    ws = tp_workspace.get(group)
    ops.fused(q, k, q_weight, k_weight, ws.counters, ws.peer_buffers, ws.status.data_ptr(), ws.rank, ws.capacity, eps,
              weight_offset, rounding == "hf")


def tp_qk_norm_nccl(q, k, q_weight, k_weight, eps, weight_offset, rounding, group, *, extension: Extension):
    """The three-launch NCCL path, from rung 1's kernels (in rung 1's extension or the tuned one)."""
    from cookbook.ops.tp_qk_norm import NUM_TENSORS, all_reduce_sum, world_of

    ops = TpOps(extension)
    tp = world_of(group)[1]
    sum_sq = torch.empty((q.shape[0], NUM_TENSORS), dtype=torch.float32, device=q.device)
    ops.sum_sq(q, k, sum_sq)
    all_reduce_sum(sum_sq, group)
    ops.apply(q, k, q_weight, k_weight, sum_sq, eps, weight_offset, q.shape[1] * tp, k.shape[1] * tp, rounding == "hf")


class TpOps:
    """torch.ops.cookbook.<extension>_<step>: a tp_qk_norm extension's ops, built on first use."""

    def __init__(self, extension: Extension):
        self.extension = extension
        if extension.name not in BUILDS:
            with _build_environment(jobs=os.cpu_count() or 1):
                _load(extension)

    def __getattr__(self, step: str):
        return getattr(torch.ops.cookbook, f"{self.extension.name}_{step}")


def tp_tuned() -> Extension:
    """tp_qk_norm's tuned extension: what backend="cuda"/"auto", the NCCL fallback and an abstaining rank run."""
    return Extension("tp_qk_norm", "tp_qk_norm/tuned.cuh")


def tp_absent(ws) -> None:
    """The launch of a rank that does not take part in a call (`cookbook.tp_workspace.abstain`),
    from the tuned extension (the same protocol as every fused kernel)."""
    TpOps(tp_tuned()).absent(ws.counters, ws.peer_buffers, ws.status.data_ptr(), ws.rank, ws.capacity)
