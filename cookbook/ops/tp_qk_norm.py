"""`tp_qk_norm`: `cross_head_norm` under tensor parallelism: each rank holds a column shard.

MiniMax-M2-style attention normalizes q over its full width (6144) and k over its full width
(1024), but under tensor parallelism (TP) each rank holds only the columns ``[T, width / tp]`` of
each and the matching slice of each weight. Gathering the shards to normalize them moves the
whole activation across GPUs; the statistic needs far less. For a token row x split into shards
x_0 .. x_{tp-1}::

    sum(x^2) = sum over ranks r of sum(x_r^2)

so each rank computes two floats per token (its shard's sum of squares of q and of k), the ranks
all-reduce just those ``[T, 2]`` floats, and each rank normalizes its own shard with its own
weight slice and the full width::

    rstd = rsqrt(total_sum_sq / full_width + eps)    (0 where that is 0: eps=0 zero rows stay 0;
                                                      NaN where it is NaN or +Inf)
    y    = x_r * rstd * (w_r + weight_offset)

Exactly `eps`, not ``eps / width`` (the error of an implementation that averages per shard and
then sums), and a finite wait for every input (eps=0 zero rows included).

Contract
--------
``tp_qk_norm(q_shard, k_shard, q_weight_shard, k_weight_shard, eps=1e-6, *, group=None, weight_offset=0.0, rounding="fused", backend="auto")``

* ``q_shard``: ``[tokens..., q_shard_width]``, ``k_shard``: ``[tokens..., k_shard_width]``, this
  rank's columns; the widths may differ between q and k; every rank holds equal shards
  (full width = shard width * tp) and the same tokens. Last dim contiguous, token stride free
  (views into a fused qkv shard), fp32/fp16/bf16; weights ``[shard_width]`` in the activation
  dtype or float32.
* ``group``: a `torch.distributed` process group (None: the default group when
  `torch.distributed` is initialized, else a single rank). tp = the group's size; tp=1 is
  `cross_head_norm`. NCCL groups take CUDA tensors, gloo groups CPU tensors (the Numba simulator
  and the reference run there).
* Collective: every rank of the group must make the same call: the same backend, token count and
  shard widths, and the same eps, weight_offset, rounding, dtype and weight storage (AGREED). A
  disagreement is an error on every rank, never a hang or a rank computing with its own values:
  the NCCL paths compare all of it with one small all-reduce first (`check_ranks_agree`); the
  fused CUDA kernel compares it in the header it exchanges (see `cookbook.tp_workspace`), leaves
  every shard untouched, and the error is raised by the next call on each rank (or by
  `raise_pending_errors()`). A rank that rejects its own arguments still takes part, to tell the
  others; a rank that never makes the call is given up on after the group's wait limit.
* ``rounding``, ``weight_offset``: as in `cross_head_norm`.
* Returns ``(q_shard, k_shard)``, normalized in place. Nothing is written unless every check passes.
* Edges, as in `cross_head_norm` (docs/edge_cases.md), per rank: the shards share no byte with
  each other or with the weight shards, no broadcast or overlapping rows, no requires-grad
  shards, no inference tensors outside inference mode; eps and weight_offset are used as
  float32. A NaN or Inf in any rank's part of a row, or a full-width sum of squares past 3.4e38,
  makes that row NaN on every rank (the NaN or Inf travels in the all-reduced sum).

Also `virtual_tp`: the sharded algorithm on full tensors in one process (the all-reduce replaced
by a sum over shards), for teaching and tests on one device or a CPU.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cookbook import _checks as C
from cookbook.ops import cross_head_norm as _cross
from cookbook.ops.qk_norm import rstd_of, scale_rows

OP = "tp_qk_norm"
MAX_SHARD_WIDTH = _cross.MAX_HIDDEN
TOLERANCES = _cross.TOLERANCES  # the same row arithmetic; only the order of the partial sums differs
NUM_TENSORS = 2  # the all-reduced sums per token: q's and k's


# --------------------------------------------------------------------------------------------
# Checks: the one function every backend runs first (local), and the cross-rank agreement.
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TPQKNormArgs:
    """Checked arguments, with the shards viewed as `[T, shard_width]` rows (no copies)."""

    q: torch.Tensor
    k: torch.Tensor
    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    weight_offset: float
    rounding: str
    group: object  # a ProcessGroup, or None for a single rank


def world_of(group) -> tuple[int, int]:
    """(rank in the group, group size); (0, 1) without torch.distributed."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_inputs(q_shard, k_shard, q_weight_shard, k_weight_shard, eps, weight_offset, rounding, group=None) -> TPQKNormArgs:
    """This rank's arguments (no communication). `check_ranks_agree` compares them across ranks."""
    expect_q, expect_k = "[tokens..., q_shard_width]", "[tokens..., k_shard_width]"
    C.require_q_k(q_shard, k_shard, expect_q, expect_k, names=("q_shard", "k_shard"))
    if q_shard.shape[:-1] != k_shard.shape[:-1]:
        raise ValueError(f"k_shard: expected the token dims of q_shard {tuple(q_shard.shape[:-1])} followed by "
                         f"k_shard_width, got {C.describe(k_shard)}")
    for name, x, expect in (("q_shard", q_shard, expect_q), ("k_shard", k_shard, expect_k)):
        width = x.shape[-1]
        if width % 2 or not 2 <= width <= MAX_SHARD_WIDTH:
            raise ValueError(f"{name}: expected an even shard width in [2, {MAX_SHARD_WIDTH}], got {C.describe(x)}")
        C.require_contiguous_last_dim(name, x, expect)
    C.require_weight("q_weight_shard", q_weight_shard, q_shard.shape[-1], q_shard, "q_shard_width")
    C.require_weight("k_weight_shard", k_weight_shard, k_shard.shape[-1], k_shard, "k_shard_width")
    eps = C.require_eps(eps)
    weight_offset = C.require_weight_offset(weight_offset)
    C.require_choice("rounding", rounding, C.ROUNDING_MODES)
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    q = C.as_token_rows("q_shard", q_shard, 1, expect_q)
    k = C.as_token_rows("k_shard", k_shard, 1, expect_k)
    check_in_place(q_shard, k_shard, q_weight_shard, k_weight_shard)
    return TPQKNormArgs(q, k, q_weight_shard, k_weight_shard, eps, weight_offset, rounding, group)


def check_in_place(q_shard, k_shard, q_weight_shard, k_weight_shard) -> None:
    """The shards writable here, each element at its own address, sharing no byte with each other
    or with the weight shards (`_checks.require_in_place`). Under torch.compile, run by the
    compiled op."""
    C.require_in_place(dict(q_shard=q_shard, k_shard=k_shard),
                       dict(q_weight_shard=q_weight_shard, k_weight_shard=k_weight_shard))


def collective_device(group, like: torch.Tensor) -> torch.device:
    """Where the group's collectives take their tensors: the current GPU for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return like.device if like.device.type == "cpu" else torch.device("cpu")


# What the ranks of a call must agree on: the shapes (a rank with more tokens would wait for sums
# nobody sends) and everything that changes the math (each rank would compute with its own).
# "rejected" is 1 + the rank of a rank that rejected its own arguments and takes part only to say
# so (its peers then raise instead of waiting for it).
AGREED = ("rejected", "tokens", "q_shard width", "k_shard width", "eps", "weight_offset", "rounding", "dtype",
          "q_weight_shard dtype", "k_weight_shard dtype", "implementation")


class WaitLimitExceeded(RuntimeError):
    """The ranks' exchange did not complete within the wait limit: the group is out of step."""


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


def agreed_values(a: TPQKNormArgs | None, rank: int, implementation: int) -> list[int]:
    """This rank's AGREED values as int64s (floats by their bits); `a` None: rejected."""
    if a is None:
        return [rank + 1] + [0] * (len(AGREED) - 1)
    return [0, a.q.shape[0], a.q.shape[1], a.k.shape[1], _float_bits(a.eps), _float_bits(a.weight_offset),
            C.ROUNDING_MODES.index(a.rounding), C.ACTIVATION_DTYPES.index(a.q.dtype),
            int(a.q_weight.dtype == torch.float32), int(a.k_weight.dtype == torch.float32), implementation]


def _shown(field: str, value: int, implementations) -> object:
    if field in ("eps", "weight_offset"):
        return _bits_float(value)
    if field == "rounding":
        return repr(C.ROUNDING_MODES[value])
    if field == "dtype":
        return C.ACTIVATION_DTYPES[value]
    if field.endswith("weight_shard dtype"):
        return "float32" if value else "the activation dtype"
    if field == "implementation":
        return repr(implementations[value - 1]) if 0 < value <= len(implementations) else value
    return value


def wait_bounded(work, seconds: float, what: str) -> None:
    """Wait for a torch.distributed request, at most `seconds`; WaitLimitExceeded after that."""
    deadline = time.monotonic() + seconds
    spin_until = time.monotonic() + 1e-3  # the common case completes within a millisecond: poll it
    while not work.is_completed():
        now = time.monotonic()
        if now > deadline:
            raise WaitLimitExceeded(what)
        if now > spin_until:
            time.sleep(1e-4)
    work.wait()


def check_ranks_agree(a: TPQKNormArgs | None, implementation: int = 0, *, group=None, wait_limit_s: float = 120.0,
                      implementations=()) -> None:
    """Every rank learns the group's smallest and largest value of each AGREED field from one
    small all-reduce (max of [v, -v, ...]), so a disagreement raises on every rank, before anything
    is written, instead of leaving ranks waiting for sums that never come or computing with other
    settings. `a` None: this rank rejected its arguments and takes part only to say so (the peers
    raise; this rank raises its own error). `implementation`: the code of the implementation this
    rank runs (names: `implementations[code - 1]`). The exchange waits at most `wait_limit_s`:
    WaitLimitExceeded after that (a rank left the call, or never made it)."""
    group = a.group if a is not None else group
    rank, world = world_of(group)
    if world == 1:
        return
    mine = agreed_values(a, rank, implementation)
    signed = torch.tensor([v for m in mine for v in (m, -m)], dtype=torch.int64,
                          device=collective_device(group, a.q if a is not None else torch.empty(0)))
    work = dist.all_reduce(signed, op=dist.ReduceOp.MAX, group=group, async_op=True)
    wait_bounded(work, wait_limit_s, (
        f"tp_qk_norm: rank {rank} waited more than {wait_limit_s:g} s for the other ranks of its group (tp={world}) "
        f"to compare their arguments: a rank left the call early, never made it, or runs the fused kernel. The "
        f"group's collectives are out of step now (this exchange is still pending), so every later tp_qk_norm call "
        f"on it raises: create a new process group"))
    hi_lo = signed.tolist()
    rejected = hi_lo[0]
    if a is None:
        return
    if rejected:
        raise RuntimeError(f"tp_qk_norm: rank {rejected - 1} of the group (tp={world}) rejected its arguments of "
                           f"this call (its own error says why): nothing was written on any rank")
    for i, field in enumerate(AGREED):
        largest, smallest = hi_lo[2 * i], -hi_lo[2 * i + 1]
        if largest == smallest:
            continue
        name, what = {"tokens": ("q_shard", "tokens"), "q_shard width": ("q_shard", "shard width"),
                      "k_shard width": ("k_shard", "shard width"), "dtype": ("q_shard", "dtype"),
                      "implementation": ("backend", "implementation"),
                      "q_weight_shard dtype": ("q_weight_shard", "dtype (float32 or the activation dtype)"),
                      "k_weight_shard dtype": ("k_weight_shard", "dtype (float32 or the activation dtype)"),
                      }.get(field, (field, field))
        show = lambda v: _shown(field, v, implementations)  # noqa: E731
        described = f"; got {C.describe(a.q if name == 'q_shard' else a.k)}" if name in ("q_shard", "k_shard") else ""
        ordered = field in ("tokens", "q_shard width", "k_shard width")  # the others: two of the values held
        group_has = (f"the group has {show(smallest)}..{show(largest)}" if ordered else
                     f"the ranks hold {show(smallest)} and {show(largest)} among others")
        raise ValueError(f"{name}: expected the same {what} on every rank of the group (tp={world}); rank {rank} has "
                         f"{show(mine[i])}, {group_has}{described}")


# --------------------------------------------------------------------------------------------
# The reference: sum of squares -> all-reduce of [T, 2] floats -> apply. The oracle for every test.
# --------------------------------------------------------------------------------------------
def local_sum_sq(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """`[T, 2]` float32: each token's sum of squares over this shard's q and k columns."""
    return torch.stack((q.float().square().sum(-1), k.float().square().sum(-1)), dim=-1)


@torch.no_grad()
def apply_sum_sq(q, k, q_weight, k_weight, sum_sq, q_full_width, k_full_width, eps, weight_offset, rounding):
    """Normalize the shards in place from the all-reduced `[T, 2]` sums and the full widths (both
    results computed before either is written; nothing recorded for autograd)."""
    q_rstd = rstd_of(sum_sq[:, 0:1] / q_full_width, eps)
    k_rstd = rstd_of(sum_sq[:, 1:2] / k_full_width, eps)
    q_out = scale_rows(q.float(), q_rstd, q_weight, weight_offset, rounding, q.dtype)
    k_out = scale_rows(k.float(), k_rstd, k_weight, weight_offset, rounding, k.dtype)
    q.copy_(q_out)
    k.copy_(k_out)


def all_reduce_sum(sum_sq: torch.Tensor, group) -> torch.Tensor:
    """Sum `sum_sq` over the ranks of `group`, in place (nothing to do at tp=1)."""
    if world_of(group)[1] > 1:
        dist.all_reduce(sum_sq, group=group)
    return sum_sq


def reference(q, k, q_weight, k_weight, eps, weight_offset, rounding, group):
    """In-place PyTorch reference on checked `[T, shard_width]` views: three steps, one collective."""
    tp = world_of(group)[1]
    sum_sq = all_reduce_sum(local_sum_sq(q, k), group)
    apply_sum_sq(q, k, q_weight, k_weight, sum_sq, q.shape[1] * tp, k.shape[1] * tp, eps, weight_offset, rounding)
    return q, k


def all_gather_norm(q, k, q_weight, k_weight, eps, weight_offset, rounding, group):
    """The naive baseline engines start from: all-gather the shards (the whole activation crosses
    the GPUs), take the statistic over the gathered row, normalize this rank's columns."""
    tp = world_of(group)[1]
    both = torch.cat((q, k), dim=1)  # one collective for q and k
    gathered = [torch.empty_like(both) for _ in range(tp)]
    if tp > 1:
        dist.all_gather(gathered, both, group=group)
    else:
        gathered[0].copy_(both)
    full = torch.stack(gathered, dim=0).float()  # [tp, T, q_w + k_w]
    q_w = q.shape[1]
    sum_sq = torch.stack((full[..., :q_w].square().sum((0, 2)), full[..., q_w:].square().sum((0, 2))), dim=-1)
    apply_sum_sq(q, k, q_weight, k_weight, sum_sq, q_w * tp, k.shape[1] * tp, eps, weight_offset, rounding)
    return q, k


def virtual_tp(q, k, q_weight, k_weight, tp, eps=1e-6, *, weight_offset=0.0, rounding="fused"):
    """The sharded algorithm in one process on FULL tensors: the columns are cut into `tp` shards,
    each shard's `[T, 2]` sums are computed on its own, the all-reduce is a sum over the shards,
    and each shard is normalized with its weight slice. In place; returns ``(q, k)``.

    Equals `cross_head_norm` on the full tensors up to the order of the float32 partial sums."""
    a = _cross.check_inputs(q, k, q_weight, k_weight, eps, weight_offset, rounding)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: expected an int >= 1, got {tp!r}")
    for name, x in (("q", a.q), ("k", a.k)):
        if x.shape[1] % (2 * tp):
            raise ValueError(f"{name}: expected a width divisible by 2 * tp = {2 * tp} (even shards), got {C.describe(x)}")
    q_shards, k_shards = a.q.tensor_split(tp, dim=1), a.k.tensor_split(tp, dim=1)
    qw_shards, kw_shards = a.q_weight.tensor_split(tp), a.k_weight.tensor_split(tp)
    partials = [local_sum_sq(qs, ks) for qs, ks in zip(q_shards, k_shards)]  # what each rank computes
    sum_sq = torch.stack(partials).sum(0)  # the all-reduce
    for qs, ks, qws, kws in zip(q_shards, k_shards, qw_shards, kw_shards):
        apply_sum_sq(qs, ks, qws, kws, sum_sq, a.q.shape[1], a.k.shape[1], eps, weight_offset, rounding)
    return q, k


# --------------------------------------------------------------------------------------------
# Inputs, tolerances, bytes: what tests, benchmarks and notebooks share.
# --------------------------------------------------------------------------------------------
def make_full_inputs(num_tokens=8, q_width=1024, k_width=256, dtype=torch.bfloat16, device="cpu", *, seed=0,
                     weight_dtype=None, kind="normal"):
    """Seeded FULL (unsharded) inputs, as `cross_head_norm.make_inputs` with fused_qkv: every
    rank draws the same ones from the same seed and keeps its columns (`shard_of`)."""
    return _cross.make_inputs(num_tokens, q_width, k_width, dtype, device, seed=seed, weight_dtype=weight_dtype,
                              fused_qkv=True, kind=kind)


def make_inputs(num_tokens=8, q_width=1024, k_width=256, dtype=torch.bfloat16, device="cpu", *, seed=0,
                weight_dtype=None, kind="normal", rank=0, tp=1):
    """Seeded arguments of one rank's call (every contract's `make_inputs`): rank `rank`'s
    shards of `make_full_inputs` (full widths `q_width`, `k_width`) at `tp` ranks."""
    full = make_full_inputs(num_tokens, q_width, k_width, dtype, device, seed=seed, weight_dtype=weight_dtype, kind=kind)
    return shard_of(full, rank, tp)


def shard_of(full: dict, rank: int, tp: int, *, fused_qkv=True) -> dict:
    """Rank `rank`'s shards of full inputs, as new tensors (as a rank holds them). With
    `fused_qkv`, q and k are views into one `[T, (q_w + 2 k_w) / tp]` qkv shard (a free token stride)."""
    q, k = (full[n].tensor_split(tp, dim=-1)[rank] for n in ("q", "k"))
    q_weight, k_weight = (full[n].tensor_split(tp)[rank].clone() for n in ("q_weight", "k_weight"))
    if fused_qkv:
        qkv = torch.cat((q, k, k), dim=-1)  # v's shard has k's width; its values do not matter here
        q, k = qkv[..., : q.shape[-1]], qkv[..., q.shape[-1] : q.shape[-1] + k.shape[-1]]
    else:
        q, k = q.clone(), k.clone()
    return dict(q_shard=q, k_shard=k, q_weight_shard=q_weight, k_weight_shard=k_weight)


def expected(full: dict, rank: int, tp: int, eps, weight_offset, rounding) -> dict:
    """{"q_shard"/"k_shard": (float64 exact value, Hugging Face-order reference or None)}: the
    matching column slice of `cross_head_norm.expected` on the full, unmodified inputs."""
    out = _cross.expected(full, eps, weight_offset, rounding)
    return {f"{n}_shard": tuple(None if t is None else t.tensor_split(tp, dim=-1)[rank] for t in out[n])
            for n in ("q", "k")}


def bytes_moved(q, k, q_weight, k_weight, tp=1) -> int:
    """Fewest bytes one rank's call must move through its memory: the shards read and written
    once, the weight shards once; plus the partial sums it sends (2 floats per token per peer)."""
    local = _cross.bytes_moved(q, k, q_weight, k_weight)
    return local + q.shape[0] * NUM_TENSORS * 4 * (tp - 1)


# The benchmark's shapes at TP=2: (tokens, q full width, k full width). MiniMax-M2: 6144 / 1024;
# the second shape: 4096 / 512.
BENCH_SHAPES = [(t, 6144, 1024) for t in (1, 8, 32, 128, 512, 2048, 8192, 16384)] + \
               [(t, 4096, 512) for t in (1, 128, 16384)]
SIM_SHAPES = [(2, 64, 32), (3, 128, 64)]
