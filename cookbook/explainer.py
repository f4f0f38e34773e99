"""Which kernel runs for a call, and why: ``cookbook.explain`` and ``python -m cookbook explain``.

    cookbook.explain("qk_norm", q, k, q_weight, k_weight)                 # the call's own tensors
    cookbook.explain("qk_norm", shape=(8192, 8, 1, 128), gpu="h100")      # a call described
    python -m cookbook explain qk_norm --shape 8192,8,1,128 --dtype bfloat16 --gpu h100

The answer comes from the tuned kernel's own host policy (``kernels_cuda/<op>/policy.h``, the code
the launcher runs before every launch), asked one of two ways:

* **on a GPU**, through the tuned extension's explain op: the launcher's code, the driver's
  occupancy for each kernel it weighs, the registers the driver reports;
* **without one** (or for another GPU: ``gpu=`` or ``sms=``), through the same policy compiled for
  the host (``kernels_cuda/<op>/explain_host.cpp``), with each kernel's registers from nvcc's
  report (``cookbook.nvcc_report``) and CUDA's occupancy calculator (``cuda_occupancy.h``) for
  the GPU named. Needs nvcc and a host C++ compiler, not a GPU.

A GPU test asks both at every bench shape and over a sweep of shapes: the two answers are equal.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kernels_cuda import KERNEL_DIR

# -------------------------------------------------------------------------------------------------
# The GPUs a call can be explained for without one. H100 and H200 (SXM) are the same chip to the
# policy: 132 SMs of compute capability 9.0, the same register file and shared memory per SM.
# -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    """What the policies and the occupancy calculator read of a GPU (cudaDeviceProp's fields)."""

    name: str
    sms: int
    major: int = 9
    minor: int = 0
    max_threads_per_block: int = 1024
    max_threads_per_sm: int = 2048
    registers_per_block: int = 65536
    registers_per_sm: int = 65536
    warp_size: int = 32
    shared_bytes_per_block: int = 48 * 1024
    shared_bytes_per_sm: int = 228 * 1024
    shared_bytes_per_block_optin: int = 227 * 1024
    reserved_shared_bytes_per_block: int = 1024

    def lines(self) -> list[str]:
        fields = ("major", "minor", "max_threads_per_block", "max_threads_per_sm", "registers_per_block",
                  "registers_per_sm", "warp_size", "shared_bytes_per_block", "shared_bytes_per_sm", "sms",
                  "shared_bytes_per_block_optin", "reserved_shared_bytes_per_block")
        return [f"gpu.{name}={getattr(self, name)}" for name in fields]

    @classmethod
    def of_device(cls, device=None) -> "Gpu":
        """The GPU torch sees (the current one by default), as the driver describes it."""
        p = torch.cuda.get_device_properties(device if device is not None else torch.cuda.current_device())
        return cls(name=p.name, sms=p.multi_processor_count, major=p.major, minor=p.minor,
                   max_threads_per_block=getattr(p, "max_threads_per_block", 1024),
                   max_threads_per_sm=p.max_threads_per_multi_processor,
                   registers_per_block=getattr(p, "regs_per_block", 65536),
                   registers_per_sm=p.regs_per_multiprocessor, warp_size=p.warp_size,
                   shared_bytes_per_block=p.shared_memory_per_block,
                   shared_bytes_per_sm=p.shared_memory_per_multiprocessor,
                   shared_bytes_per_block_optin=p.shared_memory_per_block_optin,
                   reserved_shared_bytes_per_block=getattr(p, "reserved_shared_memory_per_block", 1024))


GPUS = {"h100": Gpu("NVIDIA H100 SXM", sms=132), "h200": Gpu("NVIDIA H200 SXM", sms=132)}


def gpu_named(gpu: "str | Gpu | None" = None, sms: int | None = None) -> Gpu:
    """`gpu` ("h100", "h200", or a `Gpu`) with its SM count replaced by `sms` where given."""
    if isinstance(gpu, Gpu) and sms is None:
        return gpu
    if isinstance(gpu, Gpu):
        raise ValueError("sms: give either a Gpu or an SM count, not both")
    if gpu is not None and gpu.lower() not in GPUS:
        raise ValueError(f"gpu: expected one of {sorted(GPUS)}, got {gpu!r}")
    base = GPUS[(gpu or "h100").lower()]
    if sms is None:
        return base
    if not isinstance(sms, int) or isinstance(sms, bool) or sms < 1:
        raise ValueError(f"sms: expected a positive number of SMs, got {sms!r}")
    return Gpu(f"{base.name} with {sms} SMs" if gpu else f"a compute capability {base.major}.{base.minor} GPU with {sms} SMs",
               sms, *(getattr(base, f) for f in ("major", "minor", "max_threads_per_block", "max_threads_per_sm",
                                                 "registers_per_block", "registers_per_sm", "warp_size",
                                                 "shared_bytes_per_block", "shared_bytes_per_sm",
                                                 "shared_bytes_per_block_optin", "reserved_shared_bytes_per_block")))


# -------------------------------------------------------------------------------------------------
# The answer.
# -------------------------------------------------------------------------------------------------


@dataclass
class Explanation:
    """What one call runs. `plan` holds the policy's facts as the kernel's code states them
    (key -> text); `str()` tells them in sentences."""

    op: str
    call: str  # the call, in a line
    layout: str  # q and k: their layout and alignment, in a line
    auto: str  # what backend="auto" runs, and where
    cuda: str  # what backend="cuda" runs
    source: str  # which of the two ways answered, and for which GPU
    plan: dict[str, str] = field(default_factory=dict)
    policy: list[tuple[str, str]] = field(default_factory=list)  # (choice, why)
    summary: list[str] = field(default_factory=list)  # the policy's columns of the op page's table

    @property
    def kernel(self) -> str:
        return f"{self.plan['kernel']}<{self.plan['template_arguments']}>"

    @property
    def launches(self) -> bool:
        """Whether the call launches a kernel (an op whose plan counts no rows always does)."""
        return "rows" not in self.plan or int(self.plan["rows"]) > 0

    def launch(self) -> str:
        p = self.plan
        if not self.launches:
            return "nothing: the call has no rows"
        how = ", programmatic" if p.get("programmatic") == "true" else ""
        registers = f"; {p['registers']} registers per thread" if "registers" in p else ""
        shared = int(p.get("shared_bytes", "0"))
        return f"grid {int(p['grid']):,} x block {p['block']}{how}{registers}" + (f"; {shared} B dynamic shared" if shared else "")

    def __str__(self) -> str:
        width = max([len(label) for label, _ in self.policy] + [0])
        lines = [f"{self.op}: {self.call}", f"  {self.layout}", f"answered by {self.source}",
                 f'backend="auto": {self.auto}', f'backend="cuda": {self.cuda}']
        if self.launches:
            lines += [f"kernel: {self.kernel}", f"launch: {self.launch()}", "policy:"]
            lines += [f"  {label:<{width}}  {why}" for label, why in self.policy]
        else:
            lines.append(f"launch: {self.launch()}")
        return "\n".join(lines)


def parse_plan(text: str) -> dict[str, str]:
    plan = {}
    for line in text.strip().splitlines():
        key, _, value = line.partition("=")
        plan[key] = value
    if "error" in plan:
        raise RuntimeError(f"the policy could not answer: {plan['error']}")
    return plan


# -------------------------------------------------------------------------------------------------
# The host program: the policy compiled for the host.
# -------------------------------------------------------------------------------------------------
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _sources(root: str) -> list[Path]:
    seen, todo = {}, [root]
    while todo:
        relative = todo.pop()
        path = KERNEL_DIR / relative
        if relative in seen or not path.is_file():
            continue
        seen[relative] = path
        todo += _INCLUDE.findall(path.read_text())
    return [seen[key] for key in sorted(seen)]


def _cuda_include() -> str:
    """The CUDA toolkit's include folder (cuda_occupancy.h), from nvcc's own dry run."""
    from cookbook import nvcc_report

    if nvcc_report.nvcc() is None:
        raise RuntimeError("explaining a call without a GPU needs nvcc (the CUDA toolkit): none is on PATH")
    for folder in nvcc_report.cuda_includes():
        if (Path(folder) / "cuda_occupancy.h").is_file():
            return folder
    raise RuntimeError("cuda_occupancy.h was not found in the CUDA toolkit's include folders")


def host_program(op: str) -> Path:
    """The op's policy compiled for the host (cached by its sources' contents)."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("explaining a call without a GPU needs a host C++ compiler (c++, g++ or clang++)")
    source = f"{op}/explain_host.cpp"
    if not (KERNEL_DIR / source).is_file():
        raise RuntimeError(f"{op}: no host policy to explain (kernels_cuda/{source} does not exist)")
    digest = hashlib.sha256()
    for path in _sources(source):
        digest.update(path.relative_to(KERNEL_DIR).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    root = Path(os.environ.get("COOKBOOK_BUILD_DIR", Path.home() / ".cache" / "fused-norm-cookbook"))
    program = root / "explain" / f"{op}-{digest.hexdigest()[:12]}"
    if program.is_file():
        return program
    program.parent.mkdir(parents=True, exist_ok=True)
    aside = program.with_name(f"{program.name}.{os.getpid()}.tmp")
    run = subprocess.run([compiler, "-std=c++20", "-O1", f"-I{KERNEL_DIR}", f"-I{_cuda_include()}",
                          str(KERNEL_DIR / source), "-o", str(aside)], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"the host compiler failed on kernels_cuda/{source}:\n{run.stderr[-4000:]}")
    aside.replace(program)
    return program


_BOOL_CAST = {"(bool)1": "true", "(bool)0": "false"}  # cu++filt's spelling of a bool; c++filt prints true/false


def _split_template(demangled: str) -> tuple[str, str] | None:
    """("cookbook::ns::kernel", "v1,v2,...") of a demangled kernel name: its template arguments
    with the casts nvcc's report prints before enum values ("(cookbook::Rounding)1" -> "1") and bools
    as true/false, whichever demangler printed them."""
    name = demangled.removeprefix("void ")
    start = name.find("<")
    if start < 0:
        return None
    depth, args, current = 0, [], ""
    for char in name[start + 1:]:
        if char == "<":
            depth += 1
        elif char == ">":
            if depth == 0:
                break
            depth -= 1
        if char == "," and depth == 0:
            args.append(current)
            current = ""
        else:
            current += char
    args.append(current)
    values = [_BOOL_CAST.get(arg.strip(), re.sub(r"^\([^()]*\)", "", arg.strip())) for arg in args]
    return name[:start], ",".join(values)


def kernel_lines(op: str) -> list[str]:
    """nvcc's report of the op's tuned extension, one `kernel` line per kernel."""
    from cookbook import nvcc_report

    lines = []
    for kernel in nvcc_report.compile_extension(f"{op}_tuned"):
        split = _split_template(kernel.kernel)
        if split is None:
            continue
        if kernel.kernel.startswith("_Z"):
            raise RuntimeError("reading nvcc's report needs a demangler (cu++filt, beside nvcc, or c++filt)")
        lines.append(f"kernel {split[0]} {split[1]} {kernel.registers} {kernel.shared_bytes}")
    return lines


def ask_host(op: str, call_lines: list[str], gpu: Gpu) -> dict[str, str]:
    """The policy's plan for the call, from the host program."""
    text = "\n".join([*call_lines, *gpu.lines(), *kernel_lines(op)]) + "\n"
    run = subprocess.run([str(host_program(op))], input=text, capture_output=True, text=True)
    if run.returncode not in (0, 2):
        raise RuntimeError(f"{op}'s host policy failed:\n{run.stdout}{run.stderr}")
    return parse_plan(run.stdout)


# -------------------------------------------------------------------------------------------------
# The ops.
# -------------------------------------------------------------------------------------------------
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # cookbook::DType
_ROUNDING_CODE = {"fused": 0, "hf": 1}  # cookbook::Rounding
LAYOUTS = ("fused_qkv", "separate")


def _aligned(t: torch.Tensor, elements: int = 0) -> bool:
    """Whether `t`'s first element (moved by `elements`) sits on a 16-byte boundary. A meta tensor's
    data_ptr is its offset in bytes from a base that is taken as aligned (torch's allocations are)."""
    return (t.data_ptr() + elements * t.element_size()) % 16 == 0


class QkNorm:
    op = "qk_norm"
    shape_names = ("T", "HQ", "HK", "D")

    @staticmethod
    def inputs(shape, dtype, layout, device, weight_dtype=None) -> dict:
        t, hq, hk, d = shape
        weight_dtype = weight_dtype or dtype
        if layout == "fused_qkv":
            qkv = torch.empty(t, (hq + 2 * hk) * d, dtype=dtype, device=device)
            q = qkv[:, : hq * d].view(t, hq, d)
            k = qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
        else:
            q = torch.empty(t, hq, d, dtype=dtype, device=device)
            k = torch.empty(t, hk, d, dtype=dtype, device=device)
        w = torch.empty(d, dtype=weight_dtype, device=device)
        return dict(q=q, k=k, q_weight=w, k_weight=w.clone())

    @staticmethod
    def check(q, k, q_weight, k_weight, eps=1e-6, weight_offset=0.0, rounding="fused"):
        from cookbook.ops import qk_norm as contract

        return contract.check_arguments(q, k, q_weight, k_weight, eps, weight_offset, rounding)

    @staticmethod
    def describe_call(a, layout: str | None) -> tuple[str, str]:
        t, hq, d = a.q.shape
        hk = a.k.shape[1]
        weights = str(a.q_weight.dtype).removeprefix("torch.")
        call = (f"T={t} Hq={hq} Hk={hk} D={d}, {str(a.q.dtype).removeprefix('torch.')}, rounding={a.rounding!r}, "
                f"weights {weights}")
        where = {"fused_qkv": "q and k: views of one fused qkv tensor", "separate": "q and k: tensors of their own",
                 None: "q and k"}[layout]
        aligned = "yes" if QkNorm._rows_are_vectors(a) else "no"
        weights_aligned = "yes" if _aligned(a.q_weight) and _aligned(a.k_weight) else "no"
        return call, (f"{where} (token strides {a.q.stride(0)}, {a.k.stride(0)}); rows 16-byte aligned: {aligned}; "
                      f"weights 16-byte aligned: {weights_aligned}")

    @staticmethod
    def _rows_are_vectors(a) -> bool:
        elems = 16 // a.q.element_size()
        strides = (a.q.stride(0), a.q.stride(1), a.k.stride(0), a.k.stride(1))
        return _aligned(a.q) and _aligned(a.k) and all(s % elems == 0 for s in strides)

    @staticmethod
    def call_lines(a) -> list[str]:
        t, hq, d = a.q.shape
        return [f"dtype={_DTYPE_CODE[a.q.dtype]}", f"rounding={_ROUNDING_CODE[a.rounding]}", f"num_tokens={t}",
                f"num_q_heads={hq}", f"num_kv_heads={a.k.shape[1]}", f"head_dim={d}",
                f"rows_are_vectors={'true' if QkNorm._rows_are_vectors(a) else 'false'}",
                f"weights_are_vectors={'true' if _aligned(a.q_weight) and _aligned(a.k_weight) else 'false'}"]

    @staticmethod
    def ask_gpu(a) -> dict[str, str]:
        from cookbook import cuda, registry

        cuda.load_extension(registry.get("qk_norm", "cuda_tuned").extension)
        return parse_plan(torch.ops.cookbook.qk_norm_tuned_explain(a.q, a.k, a.q_weight, a.k_weight, a.eps,
                                                                     a.weight_offset, a.rounding == "hf"))

    @staticmethod
    def policy(p: dict[str, str], a) -> list[tuple[str, str]]:
        rows = int(p["rows"])
        heads = a.q.shape[1] + a.k.shape[1]
        head_dim = a.q.shape[2]
        ranges = int(p["token_ranges"])
        tokens = rows // heads
        rows_text = f"{rows:,} rows ({tokens:,} token{'s' if tokens != 1 else ''} x {heads} heads)" + \
            (f", the first of {ranges} token ranges of fewer than 2^32 rows" if ranges > 1 else "")
        if p["kernel"].endswith("qk_norm_v2_kernel"):
            why = (f"head_dim {head_dim} is not one the vector kernels compile (64, 128, 256, 512, 1024, 80, 96, 160, 192)"
                   if QkNorm._rows_are_vectors(a) else "a row of q or k does not start on a 16-byte boundary")
            return [("rows", rows_text), ("path", f"rung 2's warp per row: {why}"),
                    ("block", f"{p['rows_per_block']} warps, one row each")]
        sms = int(p["sms"])
        one_wave, two_wave = int(p["one_vector_wave"]), int(p["two_vector_wave"])
        one_bps, two_bps = int(p["one_vector_blocks_per_sm"]), int(p["two_vector_blocks_per_sm"])
        block = int(p["block"])
        one_rows, two_rows = block // lane_count(a, 1), block // lane_count(a, 2)
        two_vectors = rows >= one_wave
        same_kernel = lane_count(a, 1) == lane_count(a, 2)
        vectors = (f"{2 if two_vectors else 1}: {rows:,} rows {'>=' if two_vectors else '<'} one wave of one-vector blocks "
                   f"({sms} SMs x {one_bps} blocks x {one_rows} rows = {one_wave:,})")
        if two_vectors and same_kernel:
            vectors += f"; at head_dim {head_dim} one vector per lane already fills a warp: the same kernel"
        if two_vectors and not same_kernel:
            wave, wave_text = two_wave, f"two-vector blocks ({sms} x {two_bps} blocks x {two_rows} rows = {two_wave:,})"
        else:
            wave, wave_text = one_wave, f"one-vector blocks ({sms} x {one_bps} blocks x {one_rows} rows = {one_wave:,})"
        warm = p["warm_next_wave"] == "true"
        warm_text = f"{'yes' if warm else 'no'}: {rows / wave:.2f} waves of {wave_text}; it warms in more than 1 and at most 8"
        if warm:
            warm_text += f"; each lane group warms the row {int(p['rows_ahead']):,} rows ahead"
        lanes, vecs = int(p["lanes_per_row"]), int(p["vecs_per_lane"])
        return [("rows", rows_text),
                ("path", f"vectors: head_dim {head_dim} is compiled and every row starts on a 16-byte boundary"),
                ("lane group", f"{lanes} lanes x {vecs} vector{'s' if vecs > 1 else ''} of 16 bytes per row; "
                               f"{p['rows_per_block']} rows per block of {p['block']} threads"),
                ("vectors per lane", vectors),
                ("warm next wave", warm_text),
                ("weight loads", "per 16-byte vector: both weights are 16-byte aligned" if p["weight_vectors"] == "true"
                 else "per element: a weight is not 16-byte aligned")]


    # The generated "which kernel runs" table of docs/qk_norm.md: its policy columns.
    SUMMARY = ("rows", "one-vector wave", "vectors per lane", "warm the next wave")

    @staticmethod
    def summary(p: dict[str, str], a) -> list[str]:
        rows = int(p["rows"])
        if p["kernel"].endswith("qk_norm_v2_kernel"):
            return [f"{rows:,}", "-", "-", "-"]
        one_wave, two_wave = int(p["one_vector_wave"]), int(p["two_vector_wave"])
        two_vectors = rows >= one_wave
        wave = two_wave if two_vectors else one_wave
        return [f"{rows:,}", f"{one_wave:,} rows", f"{2 if two_vectors else 1}",
                f"{'yes' if p['warm_next_wave'] == 'true' else 'no'} ({rows / wave:.2f} waves)"]


class CrossHeadNorm:
    op = "cross_head_norm"
    shape_names = ("T", "QH", "KH")  # tokens, q_hidden, k_hidden

    @staticmethod
    def inputs(shape, dtype, layout, device, weight_dtype=None) -> dict:
        t, q_hidden, k_hidden = shape
        weight_dtype = weight_dtype or dtype
        if layout == "fused_qkv":
            qkv = torch.empty(t, q_hidden + 2 * k_hidden, dtype=dtype, device=device)
            q, k = qkv[:, :q_hidden], qkv[:, q_hidden: q_hidden + k_hidden]
        else:
            q = torch.empty(t, q_hidden, dtype=dtype, device=device)
            k = torch.empty(t, k_hidden, dtype=dtype, device=device)
        return dict(q=q, k=k, q_weight=torch.empty(q_hidden, dtype=weight_dtype, device=device),
                    k_weight=torch.empty(k_hidden, dtype=weight_dtype, device=device))

    @staticmethod
    def check(q, k, q_weight, k_weight, eps=1e-6, weight_offset=0.0, rounding="fused"):
        from cookbook.ops import cross_head_norm as contract

        return contract.check_inputs(q, k, q_weight, k_weight, eps, weight_offset, rounding)

    @staticmethod
    def _rows_are_vectors(a) -> bool:
        elems = 16 // a.q.element_size()
        numbers = (a.q.stride(0), a.k.stride(0), a.q.shape[1], a.k.shape[1])
        return _aligned(a.q) and _aligned(a.k) and all(n % elems == 0 for n in numbers)

    @staticmethod
    def _share_token_stride(a) -> bool:
        stride = a.q.stride(0)
        return stride == a.k.stride(0) and (stride > a.q.shape[1] or stride > a.k.shape[1])

    @staticmethod
    def describe_call(a, layout: str | None) -> tuple[str, str]:
        t, q_hidden = a.q.shape
        weights = "/".join(dict.fromkeys(str(w.dtype).removeprefix("torch.") for w in (a.q_weight, a.k_weight)))
        call = (f"T={t} q_hidden={q_hidden} k_hidden={a.k.shape[1]}, {str(a.q.dtype).removeprefix('torch.')}, "
                f"rounding={a.rounding!r}, weights {weights}")
        where = {"fused_qkv": "q and k: views of one fused qkv tensor", "separate": "q and k: tensors of their own",
                 None: "q and k"}[layout]
        yes = lambda flag: "yes" if flag else "no"  # noqa: E731
        return call, (f"{where} (token strides {a.q.stride(0)}, {a.k.stride(0)}); rows 16-byte aligned, whole vectors: "
                      f"{yes(CrossHeadNorm._rows_are_vectors(a))}; weights 16-byte aligned: "
                      f"{yes(_aligned(a.q_weight) and _aligned(a.k_weight))}")

    @staticmethod
    def call_lines(a) -> list[str]:
        flag = lambda value: "true" if value else "false"  # noqa: E731
        return [f"dtype={_DTYPE_CODE[a.q.dtype]}", f"rounding={_ROUNDING_CODE[a.rounding]}", f"num_tokens={a.q.shape[0]}",
                f"q_hidden={a.q.shape[1]}", f"k_hidden={a.k.shape[1]}",
                f"rows_are_vectors={flag(CrossHeadNorm._rows_are_vectors(a))}",
                f"weights_are_vectors={flag(_aligned(a.q_weight) and _aligned(a.k_weight))}",
                f"rows_share_token_stride={flag(CrossHeadNorm._share_token_stride(a))}"]

    @staticmethod
    def ask_gpu(a) -> dict[str, str]:
        from cookbook import cuda, registry

        cuda.load_extension(registry.get("cross_head_norm", "cuda_tuned").extension)
        return parse_plan(torch.ops.cookbook.cross_head_norm_tuned_explain(a.q, a.k, a.q_weight, a.k_weight, a.eps,
                                                                             a.weight_offset, a.rounding == "hf"))

    @staticmethod
    def _wave(p) -> str:
        return (f"{int(p['sms'])} SMs x {p['wave_blocks_per_sm']} four-warp CTAs of {p['wave_block']} threads = "
                f"{int(p['wave_rows']):,} rows")

    @staticmethod
    def policy(p: dict[str, str], a) -> list[tuple[str, str]]:
        rows, tokens = int(p["rows"]), a.q.shape[0]
        widest, vecs = int(p["widest_vecs"]), int(p["q_vecs"]) + int(p["k_vecs"])
        found = [("rows", f"{rows:,} rows: {tokens:,} token{'s' if tokens != 1 else ''} x (q, k); the wider row "
                          f"{widest} vectors of 16 bytes")]
        path = p["path"]
        if path == "warp_per_token":
            return found + [("path", f"a warp per token (rung 7): the wider row fits 8 vectors per lane, and {tokens:,} "
                                     f"tokens >= 18 x the token's {vecs} vectors = {int(p['warp_per_token_tokens']):,}"),
                            ("block", f"{p['block']} threads, a token per warp")]
        if path == "staged_row":
            return found + [("path", f"the row staged in shared memory by one bulk copy ({int(p['shared_bytes']):,} bytes "
                                     "per CTA): wider than 512 threads x 8 vectors hold in registers")]
        if path == "strided":
            why = ("a row or a weight is not whole 16-byte vectors on 16-byte boundaries"
                   if widest <= 4096 else "wider than registers hold, and no room (or no bulk copies) for a staged row")
            return found + [("path", f"rung 2's strided CTA per row: {why}")]
        vectors = re.search(r"kVecsPerThread=(\d+)", p["template_arguments"]).group(1)
        block = f"{p['block']} threads x {vectors} vectors"
        if path == "cta_per_row_below_a_wave":
            size = ("at most 128 vectors: one vector per thread of four warps, rung 6's CTA at any size"
                    if int(p["four_warp_vecs"]) == 0 else f"{rows:,} < one wave ({CrossHeadNorm._wave(p)})")
            held = "Weights::kWithTheRow" in p["template_arguments"]
            weights = (f"with the row: every row resident at once ({rows:,} <= {int(p['held_resident_rows']):,})" if held
                       else "after the sum: " + ("the rows are not all resident at once" if int(p["held_blocks_per_sm"])
                                                 else "more than four vectors per thread"))
            return found + [("size", size), ("block", f"{block}: the fewest vectors per thread in up to 512 threads"),
                            ("weights", weights)]
        order = ("token-major: q and k share a token stride (views of one tensor) and the call is 3 waves or more"
                 if p["token_major"] == "true" else "(tokens, 2)")
        shape = ("the 512-thread CTA of two vectors: rows of like widths" if p["like_rows"] == "true"
                 else f"four warps of {p['four_warp_vecs']} vectors" + (", the block compiled in" if "kBlockThreads=128"
                                                                         in p["template_arguments"] else ""))
        warm = int(p["warm_first_ctas"])
        warm_text = (f"the first {warm:,} CTAs warm their own row before the wait" if warm
                     else f"none before the wait: the call moves {int(p['call_bytes']) / 2**20:.0f} MiB (> 192)")
        if int(p["rows_ahead"]):
            warm_text += f"; every CTA warms the row {int(p['rows_ahead']):,} CTAs ahead (a wave)"
        return found + [("waves", f"{p['waves']} waves ({CrossHeadNorm._wave(p)})"),
                        ("block", f"{block}: {shape}"), ("grid order", order),
                        ("weights", "with the row" if "Weights::kWithTheRow" in p["template_arguments"] else "after the sum"),
                        ("warm", warm_text)]

    # The generated "which kernel runs" table of docs/cross_head_norm.md: its policy columns.
    SUMMARY = ("path", "waves of four-warp CTAs", "weights", "warm")

    @staticmethod
    def summary(p: dict[str, str], a) -> list[str]:
        path = p["path"]
        if not path.startswith("cta_per_row"):
            return [path.replace("_", " "), "-", "-", "-"]
        waves = p["waves"] if int(p["four_warp_vecs"]) else "-"
        held = "with the row" if "Weights::kWithTheRow" in p["template_arguments"] else "after the sum"
        warm = []
        if int(p["warm_first_ctas"]):
            warm.append(f"first {int(p['warm_first_ctas']):,} CTAs")
        if int(p["rows_ahead"]):
            warm.append("next wave")
        return [path.removeprefix("cta_per_row_").replace("_", " "), waves, held, " + ".join(warm) or "no"]


class QkNormRope:
    op = "qk_norm_rope"
    shape_names = ("T", "HQ", "HK", "D", "ROPE", "NEOX")  # NEOX: 1 NeoX pairs, 0 interleaved

    @staticmethod
    def inputs(shape, dtype, layout, device, weight_dtype=None) -> dict:
        from cookbook.ops.qk_norm_rope import Rope

        t, hq, hk, d, rope_dim, is_neox = shape
        tensors = QkNorm.inputs((t, hq, hk, d), dtype, layout, device, weight_dtype)
        cache = torch.empty(max(t, 1), rope_dim, dtype=torch.float32, device=device)  # the benchmark's table
        positions = torch.empty(t, dtype=torch.int64, device=device)
        return dict(**tensors, cos_sin_cache=cache, positions=positions, rope=Rope(is_neox=bool(is_neox)))

    @staticmethod
    def check(q, k, q_weight, k_weight, cos_sin_cache, positions, eps=1e-6, weight_offset=0.0, rounding="fused",
              rope=None, is_neox=True, rope_dim=None, position_offset=0):
        from cookbook.ops import qk_norm_rope as contract

        rope = rope or contract.Rope(is_neox=is_neox, rope_dim=rope_dim, position_offset=position_offset)
        return contract.check_inputs(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding,
                                     rope)

    @staticmethod
    def _tables_are_vectors(a) -> bool:
        return _aligned(a.q_weight) and _aligned(a.k_weight) and _aligned(a.cos_sin_cache)

    @staticmethod
    def describe_call(a, layout: str | None) -> tuple[str, str]:
        call, _ = QkNorm.describe_call(a, layout)
        rope = (f"rope_dim {a.rope_dim} of {a.q.shape[2]}, {'NeoX' if a.is_neox else 'interleaved'} pairs, cos/sin "
                f"{str(a.cos_sin_cache.dtype).removeprefix('torch.')}")
        where = {"fused_qkv": "q and k: views of one fused qkv tensor", "separate": "q and k: tensors of their own",
                 None: "q and k"}[layout]
        yes = lambda flag: "yes" if flag else "no"  # noqa: E731
        return f"{call}; {rope}", (f"{where} (token strides {a.q.stride(0)}, {a.k.stride(0)}); rows 16-byte aligned: "
                                   f"{yes(QkNorm._rows_are_vectors(a))}; weights and cos/sin 16-byte aligned: "
                                   f"{yes(QkNormRope._tables_are_vectors(a))}")

    @staticmethod
    def call_lines(a) -> list[str]:
        flag = lambda value: "true" if value else "false"  # noqa: E731
        t, hq, d = a.q.shape
        return [f"dtype={_DTYPE_CODE[a.q.dtype]}", f"rounding={_ROUNDING_CODE[a.rounding]}", f"num_tokens={t}",
                f"num_q_heads={hq}", f"num_kv_heads={a.k.shape[1]}", f"head_dim={d}", f"rope_dim={a.rope_dim}",
                f"layout={int(a.is_neox)}", f"weights={int(a.q_weight.dtype == torch.float32)}",
                f"cache={int(a.cos_sin_cache.dtype == torch.float32)}",
                f"rows_are_vectors={flag(QkNorm._rows_are_vectors(a))}",
                f"tables_are_vectors={flag(QkNormRope._tables_are_vectors(a))}"]

    @staticmethod
    def ask_gpu(a) -> dict[str, str]:
        from cookbook import cuda, registry

        cuda.load_extension(registry.get("qk_norm_rope", "cuda_tuned").extension)
        return parse_plan(torch.ops.cookbook.qk_norm_rope_tuned_explain(
            a.q, a.k, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.eps, a.weight_offset, a.is_neox,
            a.rope_dim, a.position_offset, a.rounding == "hf"))

    OFF_VECTORS = {"rows_unaligned": "a row of q or k does not start on a 16-byte boundary",
                   "tables_unaligned": "a weight or the cos/sin cache does not start on a 16-byte boundary",
                   "rope_dim_not_whole_units": "rope_dim is not a whole number of two-vector units",
                   "head_dim_not_compiled": "head_dim is not one the vector kernels compile (64, 128, 256)"}

    @staticmethod
    def policy(p: dict[str, str], a) -> list[tuple[str, str]]:
        rows = int(p["rows"])
        heads = a.q.shape[1] + a.k.shape[1]
        tokens = rows // heads
        found = [("rows", f"{rows:,} rows ({tokens:,} token{'s' if tokens != 1 else ''} x {heads} heads)")]
        if p["off_vectors"] != "none":
            return found + [("path", f"rung 2's warp per row: {QkNormRope.OFF_VECTORS[p['off_vectors']]}")]
        per_block = int(p["rows_per_block"])
        found += [("lane group", f"{p['lanes_per_row']} lanes per row, {per_block} rows per block of {p['block']} threads"),
                  ("blocks needed", f"{int(p['needed_blocks']):,} (a row per lane group)")]
        whole = (f"resident grid {int(p['whole_tokens_resident']):,} blocks ({p['sms']} SMs x "
                 f"{p['whole_tokens_blocks_per_sm']}); cut to whole tokens ({p['token_cycle_blocks']} blocks a cycle): "
                 f"{int(p['whole_tokens_cut']):,} blocks, longest walk {p['longest_walk_cut']} rows against "
                 f"{p['longest_walk_resident']}, leaves {'at most' if p['cut_leaves_few_out'] == 'true' else 'more than'} "
                 f"1/32 out")
        walk = p["walk"]
        if walk == "Walk::kWholeTokens":
            return found + [("walk", f"whole tokens (rung 7): more than one trip, and the cut keeps every walk as "
                                     f"short; {whole}"), ("step", f"{p['token_step']} tokens")]
        steps = f"{int(p['steps_resident']):,} resident blocks ({p['sms']} x {p['steps_blocks_per_sm']})"
        if walk == "Walk::kOneRow":
            return found + [("walk", f"one row per lane group (rung 6): {int(p['needed_blocks']):,} blocks fit in one "
                                     f"trip of {steps}; tables warmed before the wait")]
        return found + [("walk", f"steps: more than one trip of {steps}, and no whole-token cut ({whole})"),
                        ("step", f"{p['token_step']} tokens and {p['head_step']} heads")]

    # The generated "which kernel runs" table of docs/qk_norm_rope.md: its policy columns.
    SUMMARY = ("walk", "blocks needed")

    @staticmethod
    def summary(p: dict[str, str], a) -> list[str]:
        if p["off_vectors"] != "none":
            return ["rung 2", "-"]
        return [p["walk"].removeprefix("Walk::k"), f"{int(p['needed_blocks']):,}"]


class QkNormRopeCache:
    op = "qk_norm_rope_cache"
    shape_names = ("T", "HQ", "HK", "D", "FP8")  # FP8: 1 an FP8 cache, 0 one in the activation dtype

    @staticmethod
    def inputs(shape, dtype, layout, device, weight_dtype=None) -> dict:
        from cookbook.ops.qk_norm_rope import Rope
        from cookbook.ops.qk_norm_rope_cache import BENCH_BLOCK_SIZE, FP8

        t, hq, hk, d, fp8 = shape
        weight_dtype = weight_dtype or dtype
        if layout == "fused_qkv":
            qkv = torch.empty(t, (hq + 2 * hk) * d, dtype=dtype, device=device)
            q, k = qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d: (hq + hk) * d].view(t, hk, d)
            v = qkv[:, (hq + hk) * d:].view(t, hk, d)
        else:
            q, k, v = (torch.empty(t, h, d, dtype=dtype, device=device) for h in (hq, hk, hk))
        w = torch.empty(d, dtype=weight_dtype, device=device)
        blocks = max(t, 1) // BENCH_BLOCK_SIZE + 1
        cache_dtype = FP8 if fp8 else dtype
        caches = [torch.empty(blocks, BENCH_BLOCK_SIZE, hk, d, dtype=cache_dtype, device=device) for _ in range(2)]
        scales = dict(k_scale=torch.empty(1, device=device), v_scale=torch.empty(1, device=device)) if fp8 else {}
        return dict(q=q, k=k, v=v, q_weight=w, k_weight=w.clone(),
                    cos_sin_cache=torch.empty(max(t, 1), d, dtype=torch.float32, device=device),
                    positions=torch.empty(t, dtype=torch.int64, device=device), k_cache=caches[0], v_cache=caches[1],
                    slot_mapping=torch.empty(t, dtype=torch.int64, device=device), rope=Rope(), **scales)

    @staticmethod
    def check(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, eps=1e-6,
              weight_offset=0.0, rounding="fused", rope=None, is_neox=True, rope_dim=None, k_scale=None, v_scale=None):
        from cookbook.ops import qk_norm_rope_cache as contract

        rope = rope or contract.Rope(is_neox=is_neox, rope_dim=rope_dim)
        return contract.check_inputs(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache,
                                     slot_mapping, eps, weight_offset, rounding, rope, k_scale, v_scale)

    @staticmethod
    def _rows_are_vectors(a) -> bool:
        elems = 16 // a.q.element_size()
        strides = (a.q.stride(0), a.q.stride(1), a.k.stride(0), a.k.stride(1), a.v.stride(0), a.v.stride(1))
        return _aligned(a.q) and _aligned(a.k) and _aligned(a.v) and all(s % elems == 0 for s in strides)

    @staticmethod
    def _caches_are_vectors(a) -> bool:
        unit = 2 * 16 // a.q.element_size()  # two vectors of the row, in cache elements
        return all(_aligned(c) and all(s % unit == 0 for s in c.stride()[:3]) for c in (a.k_cache, a.v_cache))

    @staticmethod
    def describe_call(a, layout: str | None) -> tuple[str, str]:
        call, _ = QkNormRope.describe_call(a, layout)
        nb, bs = a.k_cache.shape[:2]
        cache = f"caches {nb} blocks x {bs} slots, {str(a.k_cache.dtype).removeprefix('torch.')}"
        where = {"fused_qkv": "q, k and v: views of one fused qkv tensor", "separate": "q, k and v: tensors of their own",
                 None: "q, k and v"}[layout]
        yes = lambda flag: "yes" if flag else "no"  # noqa: E731
        return f"{call}; {cache}", (f"{where} (token strides {a.q.stride(0)}, {a.k.stride(0)}, {a.v.stride(0)}); rows "
                                    f"16-byte aligned: {yes(QkNormRopeCache._rows_are_vectors(a))}; tables: "
                                    f"{yes(QkNormRope._tables_are_vectors(a))}; caches in whole units: "
                                    f"{yes(QkNormRopeCache._caches_are_vectors(a))}")

    @staticmethod
    def call_lines(a) -> list[str]:
        from cookbook.ops.qk_norm_rope_cache import FP8

        flag = lambda value: "true" if value else "false"  # noqa: E731
        t, hq, d = a.q.shape
        return [f"dtype={_DTYPE_CODE[a.q.dtype]}", f"rounding={_ROUNDING_CODE[a.rounding]}", f"num_tokens={t}",
                f"num_q_heads={hq}", f"num_kv_heads={a.k.shape[1]}", f"head_dim={d}", f"rope_dim={a.rope_dim}",
                f"layout={int(a.is_neox)}", f"weights={int(a.q_weight.dtype == torch.float32)}",
                f"cos_sin={int(a.cos_sin_cache.dtype == torch.float32)}", f"cache={int(a.k_cache.dtype == FP8)}",
                f"rows_are_vectors={flag(QkNormRopeCache._rows_are_vectors(a))}",
                f"tables_are_vectors={flag(QkNormRope._tables_are_vectors(a))}",
                f"caches_are_vectors={flag(QkNormRopeCache._caches_are_vectors(a))}",
                f"num_slots={a.k_cache.shape[0] * a.k_cache.shape[1]}"]

    @staticmethod
    def ask_gpu(a) -> dict[str, str]:
        from cookbook import cuda, registry

        cuda.load_extension(registry.get("qk_norm_rope_cache", "cuda_tuned").extension)
        return parse_plan(torch.ops.cookbook.qk_norm_rope_cache_tuned_explain(
            a.q, a.k, a.v, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.k_cache, a.v_cache, a.slot_mapping,
            a.k_scale, a.v_scale, a.eps, a.weight_offset, a.is_neox, a.rope_dim, a.rounding == "hf"))

    OFF_VECTORS = {**QkNormRope.OFF_VECTORS,
                   "rows_unaligned": "a row of q, k or v does not start on a 16-byte boundary",
                   "caches_unaligned": "a cache does not start on a 16-byte boundary or its strides are not whole "
                                       "two-vector units",
                   "index_over_31_bits": "over 2^31 rows or cache slots (the one-pass kernel indexes them in 32 bits)"}

    @staticmethod
    def policy(p: dict[str, str], a) -> list[tuple[str, str]]:
        rows = int(p["rows"])
        heads = a.q.shape[1] + 2 * a.k.shape[1]
        tokens = rows // heads
        found = [("rows", f"{rows:,} rows ({tokens:,} token{'s' if tokens != 1 else ''} x {heads} q, k and v heads)"),
                 ("cache", "FP8 e4m3 (x / scale, saturated)" if p["cache"] == "CacheDtype::kFp8E4m3"
                  else "the activation dtype")]
        if p["path"] == "split":
            return found + [("path", f"the split path (qk_norm_rope's warp per row, then rung 1's copy kernel): "
                                     f"{QkNormRopeCache.OFF_VECTORS[p['off_vectors']]}")]
        return found + [("path", "one pass: q, k and v rows in one kernel, k and v into the caches from registers"),
                        ("lane group", f"{p['lanes_per_row']} lanes per row, {p['rows_per_block']} rows per block of "
                                       f"{p['block']} threads"),
                        ("grid", f"{int(p['grid']):,} blocks, each lane group walking {p['waves']} row(s) a grid apart "
                                 f"(at most the resident blocks: {p['sms']} SMs x {p['blocks_per_sm']}; a cache of the "
                                 f"activation dtype)" if p["walk"] == "true" else
                                 f"{int(p['grid']):,} blocks, a row per lane group: {p['waves']} wave(s) of "
                                 f"{p['sms']} SMs x {p['blocks_per_sm']} blocks")]

    # The generated "which kernel runs" table of docs/qk_norm_rope_cache.md: its policy columns.
    SUMMARY = ("path", "waves")

    @staticmethod
    def summary(p: dict[str, str], a) -> list[str]:
        if p["path"] == "split":
            return ["split", "-"]
        return ["one pass", p["waves"]]


class TpQkNorm:
    """tp_qk_norm: one rank's call, the world size a number (the plan reads nothing else of the
    group). `shape` gives the full widths; each rank holds `width / world` of each."""

    op = "tp_qk_norm"
    shape_names = ("T", "QH", "KH")  # tokens, q's and k's full widths
    takes_world = True

    @staticmethod
    def _check_world(world) -> int:
        from cookbook.tp_workspace import MAX_RANKS

        if not isinstance(world, int) or isinstance(world, bool) or not 2 <= world <= MAX_RANKS:
            raise ValueError(f"world: expected the group's size, 2 to {MAX_RANKS} ranks (one rank runs "
                             f"cross_head_norm), got {world!r}")
        return world

    @staticmethod
    def inputs(shape, dtype, layout, device, weight_dtype=None, world=2) -> dict:
        t, q_full, k_full = shape
        world = TpQkNorm._check_world(world)
        for name, width in (("q_hidden", q_full), ("k_hidden", k_full)):
            if width % world:
                raise ValueError(f"shape: {name} {width} does not split into {world} equal shards")
        shards = CrossHeadNorm.inputs((t, q_full // world, k_full // world), dtype, layout, device, weight_dtype)
        return dict(q_shard=shards["q"], k_shard=shards["k"], q_weight_shard=shards["q_weight"],
                    k_weight_shard=shards["k_weight"])

    @staticmethod
    def check(q_shard, k_shard, q_weight_shard, k_weight_shard, eps=1e-6, weight_offset=0.0, rounding="fused",
              world=2):
        from types import SimpleNamespace

        from cookbook.ops import tp_qk_norm as contract

        world = TpQkNorm._check_world(world)
        checked = contract.check_inputs(q_shard, k_shard, q_weight_shard, k_weight_shard, eps, weight_offset, rounding,
                                        group=None)
        return SimpleNamespace(**{name: getattr(checked, name) for name in
                                  ("q", "k", "q_weight", "k_weight", "eps", "weight_offset", "rounding")}, world=world)

    @staticmethod
    def _capacity() -> int:
        """Tokens per chunk: the workspace's capacity (a longer call runs as several launches)."""
        from cookbook import tp_workspace

        return tp_workspace.CAPACITY_TOKENS

    @staticmethod
    def _aligned(a) -> bool:
        return CrossHeadNorm._rows_are_vectors(a) and _aligned(a.q_weight) and _aligned(a.k_weight)

    @staticmethod
    def describe_call(a, layout: str | None) -> tuple[str, str]:
        t, q_hidden = a.q.shape
        k_hidden = a.k.shape[1]
        weights = "/".join(dict.fromkeys(str(w.dtype).removeprefix("torch.") for w in (a.q_weight, a.k_weight)))
        call = (f"T={t} q_hidden={q_hidden * a.world} k_hidden={k_hidden * a.world} over {a.world} ranks (shards "
                f"{q_hidden}/{k_hidden}), {str(a.q.dtype).removeprefix('torch.')}, rounding={a.rounding!r}, weights "
                f"{weights}")
        where = {"fused_qkv": "q and k shards: views of one fused qkv shard", "separate": "q and k shards: tensors of "
                 "their own", None: "q and k shards"}[layout]
        return call, (f"{where} (token strides {a.q.stride(0)}, {a.k.stride(0)}); rows and weights 16-byte aligned, "
                      f"whole vectors: {'yes' if TpQkNorm._aligned(a) else 'no'}")

    @staticmethod
    def call_lines(a) -> list[str]:
        chunk = min(a.q.shape[0], TpQkNorm._capacity())
        return [f"dtype={_DTYPE_CODE[a.q.dtype]}", f"rounding={_ROUNDING_CODE[a.rounding]}", f"world={a.world}",
                f"num_tokens={chunk}", f"q_hidden={a.q.shape[1]}", f"k_hidden={a.k.shape[1]}",
                f"vector_aligned={'true' if TpQkNorm._aligned(a) else 'false'}"]

    @staticmethod
    def ask_gpu(a) -> dict[str, str]:
        """The tuned extension's explain op. It reads the world size from the number of peer buffers
        and dereferences none, so a world of placeholders asks it on one GPU, with no group."""
        from cookbook import cuda, tp_workspace

        counters = torch.zeros(tp_workspace.COUNTER_WORDS, dtype=torch.int32, device=a.q.device)
        status = torch.zeros(tp_workspace.STATUS_WORDS, dtype=torch.int64).pin_memory()
        no_peer_buffers = [0] * a.world
        return parse_plan(cuda.TpOps(cuda.tp_tuned()).explain(
            a.q, a.k, a.q_weight, a.k_weight, counters, no_peer_buffers, status.data_ptr(), 0, TpQkNorm._capacity(),
            a.eps, a.weight_offset, a.rounding == "hf"))

    PATHS = {"lean": "rung 7's lean kernel", "paired": "rung 8's paired kernel (two tokens per exchange)", "lagged_walk": "rung 5's lagged walk", "tiles": "rung 4's tile kernel",
             "decode_tiles": "rung 4's decode tile kernel (warps share each row)"}

    @staticmethod
    def policy(p: dict[str, str], a) -> list[tuple[str, str]]:
        t, capacity = a.q.shape[0], TpQkNorm._capacity()
        chunk = min(t, capacity)
        sms, vecs, resident = int(p["sms"]), int(p["vecs"]), int(p["resident"])
        tokens = f"{chunk:,} token{'s' if chunk != 1 else ''}"
        found = [("chunk", f"{tokens}" + (f", the first of {-(-t // capacity)} chunks of at most {capacity:,}"
                                           if t > capacity else "")),
                 ("row pair", f"{vecs} vectors of 16 bytes (q's and k's shard rows)"),
                 ("tokens per SM", f"{p['tokens_per_sm']} ({tokens} on {sms} SMs); the lean band is up to "
                                   f"{p['lean_tokens_per_sm']}")]
        path = p["path"]
        if chunk == 0:
            why = "no tokens: the launch still publishes the header and advances the epoch"
        elif not TpQkNorm._aligned(a):
            why = "a row or weight is off a 16-byte boundary or not whole vectors: one element per pack"
        elif path == "lean":
            why = f"within the lean band, at most a token per resident CTA: a CTA of {p['block']} threads per token"
        elif path == "paired":
            why = f"within the lean band, more tokens than rung 7's resident CTAs: {resident:,} CTAs of {p['block']} threads"
        elif path == "lagged_walk":
            why = (f"above the lean band, world {a.world} <= {p['lagged_max_world']}, and {tokens} >= the walk's "
                   f"{resident:,} resident CTAs: one persistent grid of them")
        elif int(p["lagged_max_world"]) < a.world:
            why = f"above the lean band at world {a.world} > {p['lagged_max_world']} (the walk is not measured there)"
        elif resident:
            why = f"above the lean band, fewer tokens than the walk's {resident:,} resident CTAs"
        else:
            why = "above the lean band, and the row pair is wider than the walk's block holds"
        found.append(("path", f"{TpQkNorm.PATHS[path]}: {why}"))
        if path in ("tiles", "decode_tiles"):
            found.append(("tiles", f"{p['tokens_per_cta']} token(s) per CTA, {p['slices_per_row']} warp(s) per row; "
                                   f"{int(p['shared_bytes']):,} B of shared memory"))
        found.append(("without peer memory", "rung 1's kernels around NCCL's all-reduce (the group's GPUs cannot all "
                                             "reach each other's memory)"))
        return found

    # The generated "which kernel runs" table of docs/tp_qk_norm.md: its policy columns.
    SUMMARY = ("path", "tokens per SM", "resident CTAs")

    @staticmethod
    def summary(p: dict[str, str], a) -> list[str]:
        resident = int(p["resident"])
        return [p["path"], p["tokens_per_sm"], f"{resident:,}" if resident else "-"]


def lane_count(a, min_vecs: int) -> int:
    """The lanes of a lane group of `a`'s head_dim holding at least `min_vecs` vectors each
    (lanes.h's lane_shape)."""
    vecs = a.q.shape[2] // (16 // a.q.element_size())
    wanted = (1 << max(vecs - 1, 0).bit_length()) // min_vecs
    return max(1, min(32, wanted))


EXPLAINERS = {"qk_norm": QkNorm, "cross_head_norm": CrossHeadNorm, "qk_norm_rope": QkNormRope,
              "qk_norm_rope_cache": QkNormRopeCache, "tp_qk_norm": TpQkNorm}


def explainable() -> list[str]:
    return list(EXPLAINERS)


def _backends(op: str, device: torch.device, hypothetical: bool) -> tuple[str, str]:
    from cookbook import registry

    tuned = registry.fastest(op)
    numba = registry.latest(op, "numba")
    if getattr(EXPLAINERS[op], "takes_world", False):  # a collective: what every rank of the group runs
        fused = (f"{tuned.name} on CUDA tensors where every GPU of the group reaches every other's memory, else "
                 f"its NCCL path (rung 1's kernels)")
        return f"{fused}; CPU tensors: the reference", fused
    if hypothetical:
        return (f"{tuned.name} on CUDA tensors of a GPU with nvcc (without nvcc: {numba.name}, the Numba kernel; "
                f"CPU tensors: the reference)", f"{tuned.name}")
    auto = registry.resolve(op, "auto", device)
    return f"{auto.name} ({auto.level})", f"{tuned.name}"


def explain(op: str, *args, shape=None, dtype=torch.bfloat16, layout: str = "fused_qkv", weight_dtype=None,
            gpu: str | None = None, sms: int | None = None, world: int | None = None, **kwargs) -> Explanation:
    """Which kernel `backend="cuda"` (and "auto") runs for this call of `op`, with which template
    arguments, grid and block, and each choice of the tuned kernel's policy with its numbers.

    Pass the call's own arguments (``explain("qk_norm", q, k, q_weight, k_weight, rounding="hf")``)
    or describe one (``shape=(T, HQ, HK, D)``, ``dtype``, ``layout="fused_qkv"`` or
    ``"separate"``, ``weight_dtype``). On a GPU, CUDA tensors are asked of the GPU itself; with
    ``gpu="h100"``/``"h200"`` or ``sms=N``, or without a GPU, the policy compiled for the host
    answers for that GPU (nvcc and a host C++ compiler needed).

    tp_qk_norm takes the group's size as ``world`` (default 2): ``shape=(T, q_hidden, k_hidden)``
    gives the full widths, one rank's shards are ``width / world``; its own tensors are shards."""
    if op not in EXPLAINERS:
        raise ValueError(f"op: expected one of {explainable()}, got {op!r}")
    spec = EXPLAINERS[op]
    if getattr(spec, "takes_world", False):
        kwargs["world"] = 2 if world is None else world
    elif world is not None:
        raise ValueError(f"world: only tp_qk_norm takes a world size, not {op}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, got {layout!r}")
    on_gpu = torch.cuda.is_available() and gpu is None and sms is None
    if shape is not None:
        if args:
            raise TypeError("explain: pass either the call's tensors or shape=, not both")
        shape = tuple(shape)
        if len(shape) != len(spec.shape_names) or not all(isinstance(n, int) and n >= 0 for n in shape):
            raise ValueError(f"shape: expected {len(spec.shape_names)} sizes ({','.join(spec.shape_names)}), "
                             f"non-negative integers, got {shape}")
        if dtype not in _DTYPE_CODE:
            raise ValueError(f"dtype: expected float32, float16 or bfloat16, got {dtype}")
        sizes = {"world": kwargs["world"]} if "world" in kwargs else {}
        tensors = spec.inputs(shape, dtype, layout, "cuda" if on_gpu else "meta", weight_dtype, **sizes)
        checked = spec.check(**tensors, **kwargs)
    else:
        checked = spec.check(*args, **kwargs)
    device = checked.q.device
    hypothetical = device.type != "cuda"
    if device.type == "cuda" and (gpu is not None or sms is not None):
        hypothetical = True
    if device.type == "cuda" and not hypothetical:
        plan = spec.ask_gpu(checked)
        source = f"the GPU: {torch.cuda.get_device_name(device)} ({Gpu.of_device(device).sms} SMs), through the tuned extension"
    else:
        target = gpu_named(gpu, sms)
        plan = ask_host(op, spec.call_lines(checked), target)
        source = (f"the policy compiled for the host, for a {target.name} ({target.sms} SMs, "
                  f"compute capability {target.major}.{target.minor}; registers from nvcc's report)")
    call, layout_line = spec.describe_call(checked, layout if shape is not None else None)
    auto, cuda = _backends(op, device, hypothetical)
    answer = Explanation(op, call, layout_line, auto, cuda, source, plan)
    if answer.launches:
        answer.policy, answer.summary = spec.policy(plan, checked), spec.summary(plan, checked)
    return answer
