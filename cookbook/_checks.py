"""Input checks shared by every op's contract.

Every backend of every op runs its op's one check function before touching memory, so a bad
input gets the same error from every backend and nothing is written. The helpers here make the
messages name the argument, its shape, stride and dtype, and what was expected, e.g.::

    q: expected [tokens..., num_q_heads, head_dim=128] with a contiguous last dim,
       got shape (4, 8, 96) stride (768, 96, 2) dtype torch.bfloat16
"""

from __future__ import annotations

import math

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


def require_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"eps: expected a float >= 0, got {eps!r}")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite float >= 0, got {eps!r}")
    return eps


def require_weight_offset(weight_offset) -> float:
    if isinstance(weight_offset, bool) or not isinstance(weight_offset, (int, float)):
        raise TypeError(f"weight_offset: expected a float (0.0, or 1.0 for Gemma), got {weight_offset!r}")
    weight_offset = float(weight_offset)
    if not math.isfinite(weight_offset):
        raise ValueError(f"weight_offset: expected a finite float, got {weight_offset!r}")
    return weight_offset


def require_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(map(repr, choices))}, got {value!r}")


def require_backend_device(backend: str, device: torch.device) -> None:
    """The compiled backends need CUDA tensors (Numba also runs CPU tensors under its simulator)."""
    if backend == "cuda" and device.type != "cuda":
        raise ValueError(
            f"backend='cuda': expected CUDA tensors, got tensors on {device}; "
            "use backend='reference' (or 'auto') for CPU tensors"
        )
    if backend == "numba" and device.type != "cuda":
        from kernels_numba import SIMULATOR  # cheap: does not import numba

        if not SIMULATOR:
            raise ValueError(
                f"backend='numba': expected CUDA tensors, got tensors on {device}; CPU tensors "
                "run the Numba kernels only under the CUDA simulator (NUMBA_ENABLE_CUDASIM=1)"
            )


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
