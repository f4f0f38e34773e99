"""Input checks shared by every op's contract.

Every backend of every op runs its op's one check function before touching memory, so a bad
input gets the same error from every backend and nothing is written. The helpers here make the
messages name the argument, its shape, stride and dtype, and what was expected, e.g.::

    q: expected [tokens..., num_q_heads, head_dim=128] with a contiguous last dim,
       got shape (4, 8, 96) stride (768, 96, 2) dtype torch.bfloat16
"""

from __future__ import annotations

import math
import struct
from typing import NamedTuple

import torch

ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROUNDING_MODES = ("fused", "hf")
BACKENDS = ("auto", "reference", "numba", "cuda")


def describe(t: torch.Tensor) -> str:
    """`shape (..) stride (..) dtype .. device ..` of a tensor, for error messages."""
    return (
        f"shape {tuple(t.shape)} stride {tuple(t.stride())} dtype {t.dtype} device {t.device}"
    )


def require_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def require_activation_dtype(name: str, t: torch.Tensor, expected: str) -> None:
    if t.dtype not in ACTIVATION_DTYPES:
        raise TypeError(
            f"{name}: expected {expected} with dtype float32, float16 or bfloat16, got {describe(t)}"
        )


def require_contiguous_last_dim(name: str, t: torch.Tensor, expected: str) -> None:
    if t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected {expected} with a contiguous last dim, got {describe(t)}")


def require_weight(name: str, w, width: int, act: torch.Tensor, width_name: str) -> None:
    """A weight is `[width]`, contiguous, on the activations' device, in their dtype or float32."""
    require_tensor(name, w)
    expected = f"[{width_name}={width}] in {act.dtype} or float32 on {act.device}"
    if w.dtype not in (act.dtype, torch.float32):
        raise TypeError(f"{name}: expected {expected}, got {describe(w)}")
    if w.dim() != 1 or w.shape[0] != width:
        raise ValueError(f"{name}: expected {expected}, got {describe(w)}")
    if w.device != act.device:
        raise ValueError(f"{name}: expected {expected}, got {describe(w)}")
    if w.shape[0] > 1 and w.stride(0) != 1:
        raise ValueError(f"{name}: expected {expected} and contiguous, got {describe(w)}")


def require_same_device_dtype(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.device != b.device:
        raise ValueError(
            f"{b_name}: expected the device of {a_name} ({a.device}), got {describe(b)}"
        )
    if a.dtype != b.dtype:
        raise TypeError(f"{b_name}: expected the dtype of {a_name} ({a.dtype}), got {describe(b)}")


def require_heads_split(name: str, t, heads_name: str, weight_name: str, w) -> None:
    """A per-head op reads a 2-D `t` as one token's ``[heads, head_dim]``. Where its weight `w`
    (``[head_dim]``) divides that row into several heads, `t` is a flattened
    ``[tokens, heads * head_dim]``: say so, and how to split it, instead of blaming the weight."""
    if not (isinstance(t, torch.Tensor) and t.dim() == 2 and isinstance(w, torch.Tensor) and w.dim() == 1):
        return
    head_dim, width = w.shape[0], t.shape[-1]
    if 0 < head_dim < width and width % head_dim == 0:
        raise ValueError(
            f"{name}: read as 2-D [{heads_name}={t.shape[0]}, head_dim={width}] (one token, no token dims), but "
            f"{weight_name} has head_dim={head_dim}; expected [tokens..., {heads_name}, head_dim={head_dim}]: view a "
            f"flattened [tokens, {heads_name} * head_dim] {name} as {name}.view({t.shape[0]}, {width // head_dim}, "
            f"{head_dim}); got {describe(t)}"
        )


def require_q_k(q, k, expect_q: str, expect_k: str, min_dims: int = 2, names=("q", "k")) -> None:
    """The preamble every q/k op shares: tensors of an activation dtype, rank at least
    `min_dims`, one device and one dtype. `names`: the arguments' names in the caller's op."""
    q_name, k_name = names
    require_tensor(q_name, q)
    require_tensor(k_name, k)
    require_activation_dtype(q_name, q, expect_q)
    require_activation_dtype(k_name, k, expect_k)
    for name, x, expect in ((q_name, q, expect_q), (k_name, k, expect_k)):
        if x.dim() < min_dims:
            raise ValueError(f"{name}: expected {expect} (at least {min_dims} dims), got {describe(x)}")
    require_same_device_dtype(q_name, q, k_name, k)


FLOAT32_MAX = float(torch.finfo(torch.float32).max)
FLOAT32_ROUNDS_TO_INF = 2.0**128 - 2.0**103  # FLOAT32_MAX + half its ulp: from here on, float32(x) is inf


def as_float32(value: float) -> float:
    """`value` rounded to float32 (to nearest even), as every kernel receives it."""
    if math.isnan(value) or abs(value) >= FLOAT32_ROUNDS_TO_INF:
        return value if math.isnan(value) else math.copysign(math.inf, value)
    return struct.unpack("f", struct.pack("f", value))[0]


def require_eps(eps) -> float:
    """eps as every backend uses it: rounded to float32 (so 1e-50 becomes 0.0). A value finite
    in Python but infinite in float32 (1e300) is rejected."""
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a float >= 0, got {eps!r}")
    eps = float(eps)
    eps32 = as_float32(eps)
    if not (eps >= 0 and math.isfinite(eps32)):
        raise ValueError(f"eps: expected a finite float >= 0 (at most {FLOAT32_MAX:.8g}: finite in float32), got {eps!r}")
    return eps32


def require_weight_offset(weight_offset) -> float:
    """weight_offset as every backend uses it: rounded to float32; infinite in float32 rejected."""
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)):
        raise TypeError(f"weight_offset: expected a float (0.0, or 1.0 for Gemma), got {weight_offset!r}")
    offset32 = as_float32(float(weight_offset))
    if not math.isfinite(offset32):
        raise ValueError(f"weight_offset: expected a finite float (|weight_offset| at most {FLOAT32_MAX:.8g}: finite "
                         f"in float32), got {weight_offset!r}")
    return offset32


def require_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


def require_backend_device(backend: str, device: torch.device) -> None:
    """The compiled backends need CUDA tensors (Numba also runs CPU tensors under its simulator);
    tensors on any other device (meta, ...) only the reference takes."""
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(
            f"backend='cuda': expected CUDA tensors, got tensors on {device}; "
            f"use backend='reference' (or 'auto') for tensors on {device}"
        )
    if backend == "numba" and device.type != "cuda":
        import kernels_numba  # cheap: does not import numba

        if device.type != "cpu":
            raise ValueError(
                f"backend='numba': expected CUDA tensors (or CPU tensors under Numba's CUDA simulator), got "
                f"tensors on {device}; use backend='reference' (or 'auto') for tensors on {device}"
            )
        if not kernels_numba.simulator():
            raise ValueError(f"backend='numba': expected CUDA tensors, got tensors on {device}; "
                             f"{kernels_numba.how_to_simulate()}")


def as_token_rows(name: str, t: torch.Tensor, trailing: int, expected: str) -> torch.Tensor:
    """View `[tokens..., *trailing dims]` as `[T, *trailing dims]` without a copy.

    The kernels take one token stride, so the leading dims must collapse into one; a view that
    cannot be collapsed would need a hidden copy, which an in-place op must not make.
    """
    lead = t.shape[: t.dim() - trailing]
    tokens = math.prod(lead)
    try:
        return t.view(tokens, *t.shape[t.dim() - trailing :])
    except RuntimeError:
        raise ValueError(
            f"{name}: expected {expected} whose token dims collapse into one stride "
            f"(no hidden copy in an in-place op), got {describe(t)}"
        ) from None


# --------------------------------------------------------------------------------------------
# In-place safety: the tensors an op writes must be writable, and share no byte of memory with
# each other or with anything the op reads (else the result would depend on the order in which a
# backend reads and writes). Checked on the addresses, exactly, before anything is written.
# --------------------------------------------------------------------------------------------
def require_in_place(written: dict, read: dict) -> None:
    """The checks of an in-place op's memory: each tensor of `written` (name -> tensor, in
    argument order) `require_writable`, and `require_disjoint` from the others and from `read`.
    Skipped while torch.compile traces the op (traced tensors have no addresses): the opaque op it
    calls runs them on the real tensors when the graph runs."""
    if torch.compiler.is_compiling():
        return
    for name, t in written.items():
        require_writable(name, t)
    require_disjoint(written, read)


def require_writable(name: str, t: torch.Tensor) -> None:
    """`t` (written in place) neither requires grad nor is an inference tensor outside inference mode."""
    if t.requires_grad:
        raise ValueError(
            f"{name}: expected a tensor that does not require grad (written in place; the op has no "
            f"backward), got {describe(t)} requires_grad=True; pass {name}.detach() to write its memory anyway"
        )
    if t.is_inference() and not torch.is_inference_mode_enabled():
        raise ValueError(
            f"{name}: expected a tensor writable here, got an inference tensor ({describe(t)}) outside "
            "torch.inference_mode(), which torch forbids writing; call the op under torch.inference_mode()"
        )


class Footprint(NamedTuple):
    """The bytes a tensor covers: `start + sum(i_k * stride_k) + [0, run)` for every index
    `0 <= i_k < count_k` of `dims` ((count, stride) pairs in bytes, by increasing stride)."""

    start: int
    run: int
    dims: tuple


def footprint(t: torch.Tensor) -> Footprint:
    """`t`'s bytes (t not empty), with dims that continue one another merged: a contiguous tensor
    is one run, a fused-qkv view one run per token."""
    item, start = t.element_size(), t.data_ptr()
    if t.is_contiguous():
        return Footprint(start, t.numel() * item, ())
    dims: list[tuple[int, int]] = []
    run = item
    for stride, count in sorted([(s * item, n) for n, s in zip(t.shape, t.stride()) if n > 1]):
        if not dims and stride == run:  # continues the run
            run *= count
        elif dims and dims[-1][0] * dims[-1][1] == stride:  # continues the previous dim
            dims[-1] = (dims[-1][0] * count, dims[-1][1])
        else:
            dims.append((count, stride))
    return Footprint(start, run, tuple(dims))


MAX_OVERLAP_CASES = 1 << 16  # multipliers an overlap proof may visit before it gives up (see below)


class TooIrregular(Exception):
    """Disjointness was not settled within MAX_OVERLAP_CASES cases."""


def _reachable(offset: int, terms: list, low: int, high: int, nonzero: bool) -> bool:
    """Whether `offset + sum(m_k * stride_k)` lies strictly between `low` and `high` for integers
    `lo_k <= m_k <= hi_k` (terms: (stride > 0, lo, hi)), not all m_k zero if `nonzero`.

    Depth first over the terms by decreasing stride; each level visits only the multipliers that
    the remaining terms could still bring into the window, so well-separated layouts (views of one
    tensor of token rows) take a handful of steps. Raises TooIrregular past MAX_OVERLAP_CASES."""
    if len(terms) == 1 and not nonzero:  # one multiplier: its range, solved directly
        stride, lo, hi = terms[0]
        return max(lo, (low - offset) // stride + 1) <= min(hi, -((offset - high) // stride) - 1)
    terms = sorted(terms, reverse=True)
    rest_min, rest_max = [0] * (len(terms) + 1), [0] * (len(terms) + 1)  # what terms[k:] can add
    for k in range(len(terms) - 1, -1, -1):
        stride, lo, hi = terms[k]
        rest_min[k], rest_max[k] = rest_min[k + 1] + lo * stride, rest_max[k + 1] + hi * stride
    stack = [(0, offset, True)]  # (level, value so far, all multipliers so far zero)
    visited = 0
    while stack:
        k, value, all_zero = stack.pop()
        if k == len(terms):
            if low < value < high and not (nonzero and all_zero):
                return True
            continue
        stride, lo, hi = terms[k]
        # low < value + m * stride + rest < high for some rest in [rest_min, rest_max]:
        first = max(lo, (low - value - rest_max[k + 1]) // stride + 1)
        last = min(hi, -((value + rest_min[k + 1] - high) // stride) - 1)
        visited += max(0, last - first + 1)
        if visited > MAX_OVERLAP_CASES:
            raise TooIrregular
        stack.extend((k + 1, value + m * stride, all_zero and m == 0) for m in range(first, last + 1))
    return False


def overlaps_itself(f: Footprint) -> bool:
    """Whether two different indices of the tensor reach one byte (a broadcast dim, heads that
    overlap...)."""
    if len(f.dims) == 1:
        return f.dims[0][1] < f.run
    strides = [stride for _, stride in f.dims]
    if 0 in strides or len(set(strides)) < len(strides):
        return True
    terms = [(stride, -(count - 1), count - 1) for count, stride in f.dims]
    return _reachable(0, terms, -f.run, f.run, nonzero=True)


def overlap(a: Footprint, b: Footprint) -> bool:
    """Whether two footprints share a byte."""
    span: dict[int, tuple[int, int]] = {}  # stride -> the range of its multiplier: a's i minus b's j
    for count, stride in a.dims:
        lo, hi = span.get(stride, (0, 0))
        span[stride] = (lo, hi + count - 1)
    for count, stride in b.dims:
        lo, hi = span.get(stride, (0, 0))
        span[stride] = (lo - (count - 1), hi)
    terms = [(stride, lo, hi) for stride, (lo, hi) in span.items() if stride > 0]
    return _reachable(a.start - b.start, terms, -a.run, b.run, nonzero=False)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """(first byte, one past the last byte) of a non-empty tensor: the cheap first test."""
    start, item = t.data_ptr(), t.element_size()
    if t.is_contiguous():
        return start, start + t.numel() * item
    return start, start + item * (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride())))


def require_disjoint(written: dict, read: dict) -> None:
    """No tensor of `written` (name -> tensor, in argument order; written in place) has two
    elements at one address or shares a byte with another argument; those of `read` (read-only)
    may share memory with each other. An error names the later argument of an overlapping pair.
    Empty tensors, and meta tensors (no memory), cover nothing."""
    tensors = {name: t for name, t in (*written.items(), *read.items()) if t.numel() and t.device.type != "meta"}
    extents = [(name, *_extent(t)) for name, t in tensors.items()]
    prints: dict[str, Footprint] = {}  # computed where the extents alone do not settle it

    def footprint_of(name: str) -> Footprint:
        if name not in prints:
            prints[name] = footprint(tensors[name])
        return prints[name]

    name = ""
    try:
        for name, t in tensors.items():
            if name in written and not t.is_contiguous() and overlaps_itself(footprint_of(name)):
                raise ValueError(
                    f"{name}: expected every element at its own memory location (written in place), got "
                    f"{describe(t)}: a broadcast or overlapping view")
        for j, (name, start, end) in enumerate(extents):
            for earlier, earlier_start, earlier_end in extents[:j]:
                if earlier_end <= start or end <= earlier_start or (earlier not in written and name not in written):
                    continue
                if overlap(footprint_of(earlier), footprint_of(name)):
                    why = "both are written in place" if name in written else f"{earlier} is written in place"
                    raise ValueError(
                        f"{name}: expected memory disjoint from {earlier} ({why}), got {describe(tensors[name])} "
                        f"sharing memory with {earlier} {describe(tensors[earlier])}; pass separate tensors")
    except TooIrregular:
        raise ValueError(
            f"{name}: expected memory provably disjoint from the op's other tensors, got {describe(tensors[name])} "
            f"sharing a buffer with them in a layout too irregular to check (over {MAX_OVERLAP_CASES} cases); "
            "pass separate tensors, or views of one tensor of token rows") from None
