"""The calling convention of a peer kernel in the benchmark, and the layout facts peers ask about.

A peer is registered (level "peer", with its package) by a factory that returns a `PeerKernel`:
called like every implementation, ``kernel(*checked_args)``, on the tensors the op's
``check_inputs`` returned, it runs the peer's public API the way a user of that package would and
returns the outputs, ``(q, k)``: the inputs themselves where the peer works in place, new tensors
where it writes new ones (their allocation is timed with it: that is what it does).

Before the first call the benchmark asks `not_applicable`: a peer that does not take the layout
(separate tensors or views of one fused qkv tensor, a dtype, a head size) says why, and is
reported so rather than skipped. `prepare` builds, outside the timed calls, what an engine
computes once per forward pass rather than per layer (never the peer's own work).
"""

from __future__ import annotations

import functools

import torch

from cookbook.peers.guard import PeerUnavailable

HALF_DTYPES = (torch.float16, torch.bfloat16)


class PeerKernel:
    """One peer API, called the registry's way. Subclasses set `api` and implement `__call__`."""

    api = ""  # the peer's public function, as a user calls it
    writes_new = False  # True where the peer returns new tensors instead of writing q and k

    def __init__(self, package: str):
        self.package = package  # "<distribution> <version>", as the results pages name it

    def label(self, device) -> str:
        """The name results pages give it: its package and version (and which of its paths ran)."""
        return self.package

    def not_applicable(self, *args) -> str | None:
        """None where the peer takes these checked arguments, else the reason it does not."""
        return None

    def prepare(self, *args) -> None:
        """Build what an engine computes once per forward pass for this argument set."""

    def __call__(self, *args):
        raise NotImplementedError


def peer(check):
    """Decorate a peer factory with its import guard: ``factory.unavailable()`` is None where the
    peer can be built here, else the reason (`check` raises PeerUnavailable; its message)."""

    def decorate(factory):
        @functools.cache
        def unavailable() -> str | None:
            try:
                check()
            except PeerUnavailable as error:
                return str(error)
            except Exception as error:  # an installed peer whose import breaks: say so, run the rest
                return f"import failed: {type(error).__name__}: {error}"
            return None

        factory.unavailable = unavailable
        return factory

    return decorate


# --------------------------------------------------------------------------------------------
# Layout facts: what a peer's own argument checks look at.
# --------------------------------------------------------------------------------------------
def contiguous_rows(x: torch.Tensor) -> bool:
    """A `[T, ...]` tensor whose rows follow each other (a view of a fused qkv tensor does not)."""
    return x.is_contiguous()


def packed_qkv(q: torch.Tensor, k: torch.Tensor):
    """`(qkv, num_v_heads)` where `[T, Hq, D]` q and `[T, Hk, D]` k are views of one contiguous
    `[T, (Hq + Hk + Hv) * D]` tensor laid out q | k | v (an engine's fused projection), with
    `qkv` a 2-D view of it (no copy); None otherwise."""
    tokens, q_heads, head_dim = q.shape
    k_heads = k.shape[1]
    width = q.stride(0)
    if q.stride(1) != head_dim or k.stride(1) != head_dim or k.stride(0) != width or width % head_dim:
        return None
    v_heads = width // head_dim - q_heads - k_heads
    item = q.element_size()
    if v_heads < 0 or k.data_ptr() != q.data_ptr() + q_heads * head_dim * item:
        return None
    if q.untyped_storage().nbytes() < (q.storage_offset() + tokens * width) * item:
        return None  # the last row's v heads are not there: not one packed tensor
    qkv = torch.as_strided(q, (tokens, width), (width, 1))
    return qkv, v_heads


def describe_layout(q: torch.Tensor, k: torch.Tensor) -> str:
    """"views of one fused qkv tensor" or "separate contiguous tensors", for reasons."""
    if q.is_contiguous() and k.is_contiguous():
        return "separate contiguous tensors"
    return "strided views (of one fused qkv tensor)"
