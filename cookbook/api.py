"""The public ops: check the arguments once, pick the implementation, run it in place.

Each op's contract (math, checks, reference, inputs, tolerances) lives in `cookbook.ops.<op>`;
the implementations are listed in `cookbook.registry`. Under `torch.compile` each op is one opaque
custom op (it mutates q and k and returns nothing), so the registry lookup and the lazy build
run when the graph runs, and CUDA graphs capture the kernels it launches.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.distributed as dist

from cookbook import _checks as C
from cookbook import registry
from cookbook.ops import cross_head_norm as cross_head_norm_contract
from cookbook.ops import qk_norm as qk_norm_contract
from cookbook.ops import qk_norm_rope as qk_norm_rope_contract
from cookbook.ops import qk_norm_rope_cache as qk_norm_rope_cache_contract
from cookbook.ops import tp_qk_norm as tp_contract

_BACKENDS_DOC = """backend: "auto" (default): on CUDA tensors the tuned CUDA C kernel, or, on a GPU
            machine without nvcc (no CUDA toolkit found: set CUDA_HOME), the last Numba kernel
            (and where Numba cannot run either, the PyTorch reference, with a RuntimeWarning);
            on CPU tensors the PyTorch reference. "cuda": the tuned CUDA C kernel (built on
            first use, a few seconds). "numba": the last Numba kernel (on CPU tensors only
            under NUMBA_ENABLE_CUDASIM=1). "reference": the PyTorch reference, on any device."""


def _as_op(name: str, run, check_in_place, mutates=("q", "k")):
    """`run` as the custom op cookbook::<name> (what torch.compile sees), with its fake kernel.
    The op runs `check_in_place(*args)` first: tracing skips the memory checks (traced tensors
    have no addresses), so they run on the real tensors when the graph runs."""

    @functools.wraps(run)
    def checked_run(*args):
        check_in_place(*args)
        run(*args)

    op = torch.library.custom_op(f"cookbook::{name}", checked_run, mutates_args=mutates)

    @op.register_fake
    def _(*args):
        return None

    return op


# --------------------------------------------------------------------------------------------
# qk_norm
# --------------------------------------------------------------------------------------------
def qk_norm(q, k, q_weight, k_weight, eps=1e-6, *, weight_offset=0.0, rounding="fused", backend="auto"):
    """Per-head RMSNorm of q and k, in place, q and k in one launch; returns ``(q, k)``.

    For every (token, head) row ``x`` of q and of k, accumulated in float32::

        y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)

    Args:
        q: ``[tokens..., num_q_heads, head_dim]``, float32, float16 or bfloat16; head_dim even,
            from 2 to 1024. The last dim contiguous; token and head strides are free (a view
            into a fused qkv tensor works). A flattened ``[tokens, num_q_heads * head_dim]`` q
            must be viewed as ``[tokens, num_q_heads, head_dim]`` first: a 2-D q is one token.
        k: ``[tokens..., num_kv_heads, head_dim]``, the dtype, device, token dims and head_dim of q
            (any GQA ratio).
        q_weight, k_weight: ``[head_dim]``, contiguous, in q's dtype or float32, on q's device.
        eps: added to mean(x^2) inside the square root; a finite float >= 0.
        weight_offset: added to the weights in float32 (1.0 for Gemma's ``(1 + w)``).
        rounding: "fused" rounds once at the end (FlashInfer, SGLang); "hf" in Hugging Face's
            order, ``round(round(x * rstd) * round(w + weight_offset))``.
        {backends}

    Returns:
        ``(q, k)``: the same tensors, normalized in place.

    Raises:
        ValueError, TypeError: a bad argument, named in the message with its shape, stride and
            dtype and what was expected. Nothing is written unless every check passes.
        RuntimeError: the backend cannot run here (e.g. backend="cuda" without a GPU).

    The contract, its tolerances and the bench shapes: `cookbook.ops.qk_norm`.

    Examples:
        On a CPU (``backend="auto"`` is the PyTorch reference there):

        >>> import torch, cookbook
        >>> q = torch.randn(4, 8, 128, dtype=torch.bfloat16)  # [tokens, q heads, head_dim]
        >>> k = torch.randn(4, 2, 128, dtype=torch.bfloat16)  # [tokens, kv heads, head_dim]
        >>> w = torch.ones(128, dtype=torch.bfloat16)
        >>> q, k = cookbook.qk_norm(q, k, w, w, eps=1e-6)  # in place; returns the same tensors
        >>> round(q.float().square().mean().item(), 1)  # each head's mean square is now about 1
        1.0
        >>> qkv = torch.randn(4, (8 + 2 + 2) * 128)  # a fused projection's output: q, k, v
        >>> q, k = qkv[:, :1024].view(4, 8, 128), qkv[:, 1024:1280].view(4, 2, 128)  # views
        >>> _ = cookbook.qk_norm(q, k, torch.ones(128), torch.ones(128))  # v is left alone
    """
    C.require_choice("backend", backend, C.BACKENDS)
    a = qk_norm_contract.check_inputs(q, k, q_weight, k_weight, eps, weight_offset, rounding)
    if a.q.shape[0] == 0:
        return q, k
    run = _qk_norm_op if torch.compiler.is_compiling() else _run_qk_norm
    run(a.q, a.k, a.q_weight, a.k_weight, a.eps, a.weight_offset, a.rounding, backend)
    return q, k


def _run_qk_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                 weight_offset: float, rounding: str, backend: str) -> None:
    registry.resolve("qk_norm", backend, q.device).fn(q, k, q_weight, k_weight, eps, weight_offset, rounding)


_qk_norm_op = _as_op("qk_norm_dispatch", _run_qk_norm,
                     lambda q, k, q_weight, k_weight, *_: qk_norm_contract.check_in_place(q, k, q_weight, k_weight))


# --------------------------------------------------------------------------------------------
# cross_head_norm
# --------------------------------------------------------------------------------------------
def cross_head_norm(q, k, q_weight, k_weight, eps=1e-6, *, weight_offset=0.0, rounding="fused", backend="auto"):
    """RMSNorm of each token's whole q row and whole k row (across heads), in place; returns ``(q, k)``.

    For every token, over all of q's columns (``num_q_heads * head_dim``) and, separately, all of
    k's, accumulated in float32: ``y = x * rsqrt(mean(x^2) + eps) * (w + weight_offset)``.

    Args:
        q: ``[tokens..., q_hidden]`` or ``[tokens..., num_q_heads, head_dim]`` with packed heads;
            float32, float16 or bfloat16, last dim contiguous, token stride free. q_hidden even,
            from 2 to 65536.
        k: the same for k (its own hidden size, the same range), the dtype, device and token
            dims of q.
        q_weight, k_weight: ``[q_hidden]`` and ``[k_hidden]``, contiguous, in q's dtype or
            float32, on q's device.
        eps, weight_offset, rounding: as in `qk_norm`.
        {backends}

    Returns:
        ``(q, k)``, normalized in place. Bad arguments raise ValueError or TypeError naming the
        argument before anything is written.

    The contract: `cookbook.ops.cross_head_norm`.

    Examples:
        On a CPU (``backend="auto"`` is the PyTorch reference there):

        >>> import torch, cookbook
        >>> q, k = torch.randn(4, 1024), torch.randn(4, 256)  # [tokens, q_hidden], [tokens, k_hidden]
        >>> q, k = cookbook.cross_head_norm(q, k, torch.ones(1024), torch.ones(256), eps=1e-6)
        >>> round(q.square().mean(-1)[0].item(), 2)  # each token's whole row: mean square about 1
        1.0
    """
    C.require_choice("backend", backend, C.BACKENDS)
    a = cross_head_norm_contract.check_inputs(q, k, q_weight, k_weight, eps, weight_offset, rounding)
    if a.q.shape[0] == 0:
        return q, k
    run = _cross_head_norm_op if torch.compiler.is_compiling() else _run_cross_head_norm
    run(a.q, a.k, a.q_weight, a.k_weight, a.eps, a.weight_offset, a.rounding, backend)
    return q, k


def _run_cross_head_norm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                         weight_offset: float, rounding: str, backend: str) -> None:
    registry.resolve("cross_head_norm", backend, q.device).fn(q, k, q_weight, k_weight, eps, weight_offset, rounding)


_cross_head_norm_op = _as_op(
    "cross_head_norm_dispatch", _run_cross_head_norm,
    lambda q, k, q_weight, k_weight, *_: cross_head_norm_contract.check_in_place(q, k, q_weight, k_weight))


# --------------------------------------------------------------------------------------------
# qk_norm_rope
# --------------------------------------------------------------------------------------------
def qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, positions, eps=1e-6, *, is_neox=True, rope_dim=None,
                 position_offset=0, weight_offset=0.0, rounding="fused", validate_positions=False, backend="auto"):
    """Per-head RMSNorm then rotary embedding of q and k, in place, in one pass; returns ``(q, k)``.

    Each (token, head) row is normalized as in `qk_norm`, then its first ``rope_dim`` columns
    are rotated by the angle of the token's position (read from ``cos_sin_cache``).

    Args:
        q, k, q_weight, k_weight, eps, weight_offset, rounding: as in `qk_norm` (head_dim even,
            from 2 to 1024; the weights ``[head_dim]``, contiguous).
        cos_sin_cache: ``[max_position, rope_dim]``, contiguous: cos of each position's angles in
            the first half of a row, sin in the second; float32 or the activation dtype.
        positions: ``[tokens]`` int32 or int64, each in ``[0, max_position - position_offset)``.
        is_neox: True rotates the pairs (i, i + rope_dim / 2) (NeoX, Llama); False the
            neighbouring pairs (2i, 2i + 1) (GPT-J, interleaved).
        rope_dim: the rotated columns, even, at most head_dim (None: all of head_dim).
        position_offset: added to every position before the cache lookup.
        validate_positions: check the positions' range on the host first (a device sync).
        {backends}

    Returns:
        ``(q, k)``, normalized and rotated in place. Bad arguments raise ValueError or TypeError
        naming the argument before anything is written.

    The contract: `cookbook.ops.qk_norm_rope`.

    Examples:
        On a CPU (``backend="auto"`` is the PyTorch reference there):

        >>> import torch, cookbook
        >>> q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)  # [tokens, heads, head_dim]
        >>> angles = torch.arange(16.0)[:, None] * 10000.0 ** (-torch.arange(0, 64, 2) / 64)
        >>> cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [16 positions, rope_dim=64]
        >>> w = torch.ones(64)
        >>> q, k = cookbook.qk_norm_rope(q, k, w, w, cos_sin_cache, torch.tensor([0, 1, 2]))
        >>> round(q.square().mean(-1)[2, 0].item(), 2)  # normalized; the rotation keeps the norm
        1.0
    """
    C.require_choice("backend", backend, C.BACKENDS)
    rope = qk_norm_rope_contract.Rope(is_neox, rope_dim, position_offset)
    a = qk_norm_rope_contract.check_inputs(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset,
                                           rounding, rope)
    if validate_positions:
        if torch.compiler.is_compiling():
            raise RuntimeError("validate_positions=True reads positions on the host (a sync): not under torch.compile")
        qk_norm_rope_contract.check_positions_in_range(a.positions, a.position_offset, a.cos_sin_cache.shape[0])
    if a.q.shape[0] == 0:
        return q, k
    run = _qk_norm_rope_op if torch.compiler.is_compiling() else _run_qk_norm_rope
    run(a.q, a.k, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.eps, a.weight_offset, a.rounding, a.is_neox,
        a.rope_dim, a.position_offset, backend)
    return q, k


def _run_qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      cos_sin_cache: torch.Tensor, positions: torch.Tensor, eps: float, weight_offset: float,
                      rounding: str, is_neox: bool, rope_dim: int, position_offset: int, backend: str) -> None:
    registry.resolve("qk_norm_rope", backend, q.device).fn(
        q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox, rope_dim,
        position_offset)


_qk_norm_rope_op = _as_op(
    "qk_norm_rope_dispatch", _run_qk_norm_rope,
    lambda q, k, q_weight, k_weight, cos_sin_cache, positions, *_: qk_norm_rope_contract.check_in_place(
        q, k, q_weight, k_weight, cos_sin_cache, positions))


# --------------------------------------------------------------------------------------------
# qk_norm_rope_cache
# --------------------------------------------------------------------------------------------
def qk_norm_rope_cache(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping,
                       eps=1e-6, *, is_neox=True, rope_dim=None, k_scale=None, v_scale=None, weight_offset=0.0,
                       rounding="fused", validate_slots=False, backend="auto"):
    """`qk_norm_rope` of q and k in place, then k (as written) and v stored into a paged KV cache,
    in one pass; returns ``(q, k)``.

    Token t with ``s = slot_mapping[t]`` writes its k and v heads to ``k_cache[s // block_size,
    s % block_size]`` and ``v_cache[...]``; ``s = -1`` skips the token. An FP8 cache stores
    ``x / scale`` saturated to +-448, rounded to e4m3 (vLLM's FP8 cache).

    Args:
        q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox,
            rope_dim: as in `qk_norm_rope`; q and k are both written back in place.
        v: ``[tokens..., num_kv_heads, head_dim]``, k's shape, dtype and device (read only); q, k
            and v may be views of one fused qkv tensor.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, last dim
            contiguous, one shape; dtype q's or ``torch.float8_e4m3fn``.
        slot_mapping: ``[tokens]`` int32 or int64: each token's cache slot, or -1.
        k_scale, v_scale: with an FP8 cache, float32 tensors of one element (the per-tensor
            scales, read on the device); otherwise None.
        validate_slots: check on the host first that every slot is -1 or in range and no slot
            repeats (a device sync). Without it an out-of-range slot writes nothing.
        {backends}

    Returns:
        ``(q, k)``, normalized and rotated in place; the caches written. Bad arguments raise
        ValueError or TypeError naming the argument before anything is written.

    The contract: `cookbook.ops.qk_norm_rope_cache`.

    Examples:
        On a CPU (``backend="auto"`` is the PyTorch reference there):

        >>> import torch, cookbook
        >>> q, k, v = torch.randn(3, 4, 64), torch.randn(3, 2, 64), torch.randn(3, 2, 64)
        >>> angles = torch.arange(16.0)[:, None] * 10000.0 ** (-torch.arange(0, 64, 2) / 64)
        >>> cos_sin_cache = torch.cat([angles.cos(), angles.sin()], dim=-1)  # [16 positions, 64]
        >>> k_cache, v_cache = torch.zeros(2, 4, 2, 64), torch.zeros(2, 4, 2, 64)  # 2 blocks of 4 slots
        >>> w = torch.ones(64)
        >>> _ = cookbook.qk_norm_rope_cache(q, k, v, w, w, cos_sin_cache, torch.tensor([0, 1, 2]), k_cache,
        ...                                 v_cache, torch.tensor([5, -1, 0]))
        >>> torch.equal(k_cache[1, 1], k[0]), torch.equal(v_cache[0, 0], v[2])  # slot 5: block 1, row 1
        (True, True)
    """
    C.require_choice("backend", backend, C.BACKENDS)
    rope = qk_norm_rope_contract.Rope(is_neox, rope_dim, 0)
    if validate_slots and torch.compiler.is_compiling():
        raise RuntimeError("validate_slots=True reads slot_mapping on the host (a sync): not under torch.compile")
    a = qk_norm_rope_cache_contract.check_inputs(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache,
                                                 v_cache, slot_mapping, eps, weight_offset, rounding, rope, k_scale,
                                                 v_scale, validate_slots)
    if a.q.shape[0] == 0:
        return q, k
    run = _qk_norm_rope_cache_op if torch.compiler.is_compiling() else _run_qk_norm_rope_cache
    run(a.q, a.k, a.v, a.q_weight, a.k_weight, a.cos_sin_cache, a.positions, a.k_cache, a.v_cache, a.slot_mapping,
        a.k_scale, a.v_scale, a.eps, a.weight_offset, a.rounding, a.is_neox, a.rope_dim, backend)
    return q, k


def _run_qk_norm_rope_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_weight: torch.Tensor,
                            k_weight: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
                            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, eps: float,
                            weight_offset: float, rounding: str, is_neox: bool, rope_dim: int, backend: str) -> None:
    registry.resolve("qk_norm_rope_cache", backend, q.device).fn(
        q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale, v_scale, eps,
        weight_offset, rounding, is_neox, rope_dim)


_qk_norm_rope_cache_op = _as_op(
    "qk_norm_rope_cache_dispatch", _run_qk_norm_rope_cache,
    lambda *args: qk_norm_rope_cache_contract.check_in_place(*args[:12]),
    mutates=("q", "k", "k_cache", "v_cache"))


# --------------------------------------------------------------------------------------------
# tp_qk_norm: a collective
# --------------------------------------------------------------------------------------------
def tp_qk_norm(q_shard, k_shard, q_weight_shard, k_weight_shard, eps=1e-6, *, group=None, weight_offset=0.0,
               rounding="fused", backend="auto"):
    """`cross_head_norm` of q and k split by columns over the ranks of `group`, in place on this
    rank's shards; returns ``(q_shard, k_shard)``. A collective: every rank makes the same call.

    Each rank sums the squares of its columns; only those two floats per token cross the GPUs
    (an all-reduce); each rank then normalizes its shard with the full width's statistic.

    Args:
        q_shard: ``[tokens..., q_shard_width]``, this rank's columns of q (full width = shard
            width * ranks), the shard width even, from 2 to 65536; k_shard likewise; the same
            tokens on every rank.
        q_weight_shard, k_weight_shard: this rank's slices of the weights, ``[q_shard_width]``
            and ``[k_shard_width]``, contiguous, in the shards' dtype or float32.
        eps, weight_offset, rounding: as in `qk_norm`.
        group: a torch.distributed process group (None: the default group when one is
            initialized, else a single rank, which is `cross_head_norm`). NCCL groups take CUDA
            tensors, gloo groups CPU tensors.
        backend: "auto" (default): on CUDA tensors as "cuda", on CPU tensors the PyTorch
            reference. "cuda": the CUDA C kernels (built on first use; they need nvcc, with no
            Numba fallback for this collective): the fused kernel where every rank's GPU can
            write into every other's memory, else the NCCL pipeline (said once). "numba": the
            last Numba pipeline (on CPU tensors only under NUMBA_ENABLE_CUDASIM=1).
            "reference": the PyTorch reference, on any device.

    Returns:
        ``(q_shard, k_shard)``, normalized in place.

    Raises:
        ValueError, TypeError: a bad argument on this rank (the other ranks then raise too: this
            rank still takes part in the call, to tell them), or ranks that disagree on the shapes
            or on anything that changes the math (eps, weight_offset, rounding, dtypes, the
            implementation): an error on every rank, nothing written. The fused kernel reports a
            disagreement at the next call (or `cookbook.api.raise_pending_errors()`).
        RuntimeError: another rank rejected its call; or a rank waited longer than the group's
            wait limit (`cookbook.tp_workspace`: a rank left the call or never made it), which
            ends the group's use: every later call on it raises.

    The contract: `cookbook.ops.tp_qk_norm`.

    Examples:
        Without a process group, one rank holds the whole row (`cross_head_norm`); `virtual_tp`
        runs the sharded algorithm in one process. On ranks, see notebook 03.

        >>> import torch, cookbook
        >>> q, k = torch.randn(4, 1024), torch.randn(4, 256)
        >>> q, k = cookbook.tp_qk_norm(q, k, torch.ones(1024), torch.ones(256))  # no group: one rank
        >>> round(q.square().mean(-1)[0].item(), 2)
        1.0
    """
    C.require_choice("backend", backend, C.BACKENDS)
    try:
        a = tp_contract.check_inputs(q_shard, k_shard, q_weight_shard, k_weight_shard, eps, weight_offset, rounding,
                                     group)
    except (ValueError, TypeError):
        _abstain(group, backend)  # the peers are told, not left waiting
        raise
    if tp_contract.world_of(a.group)[1] == 1:  # tp=1: the whole row is here
        cross_head_norm(a.q, a.k, a.q_weight, a.k_weight, a.eps, weight_offset=a.weight_offset, rounding=a.rounding,
                        backend=backend)
        return q_shard, k_shard
    if torch.compiler.is_compiling():
        # One opaque op that mutates the shards (the group travels by name); the path choice, the
        # rank check and the launch run when the graph runs.
        _tp_qk_norm_op(a.q, a.k, a.q_weight, a.k_weight, a.eps, a.weight_offset, a.rounding, backend,
                       a.group.group_name)
    else:
        _run_tp_qk_norm(a, backend)
    return q_shard, k_shard


def _run_tp_qk_norm(a: tp_contract.TPQKNormArgs, backend: str) -> None:
    """The collective call on checked arguments: pick the path, check the ranks agree, launch."""
    from cookbook import tp_workspace

    ended = tp_workspace.failure(a.group)
    if ended:
        raise RuntimeError(ended)
    try:
        impl = resolve_tp(backend, a)
        raise_pending_errors(a.group)  # what an earlier fused launch of this rank reported
    except (ValueError, RuntimeError):
        if not tp_workspace.failure(a.group):  # a group that has ended takes no part in anything
            _abstain(a.group, backend)
        raise
    if not is_fused(impl):  # the fused kernel compares the ranks' headers on the GPU instead
        capturing = a.q.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:  # a CUDA-graph capture cannot read the all-reduced values back
            names = [i.name for i in registry.implementations(tp_contract.OP)]
            try:
                tp_contract.check_ranks_agree(a, names.index(impl.name) + 1, implementations=names,
                                              wait_limit_s=tp_workspace.state(a.group).wait_limit_s)
            except tp_contract.WaitLimitExceeded as error:
                tp_workspace.fail(a.group, str(error))
                raise
        if a.q.shape[0] == 0:
            return
        impl.fn(a.q, a.k, a.q_weight, a.k_weight, a.eps, a.weight_offset, a.rounding, a.group)
        return
    tp_workspace.count_call(a.group)  # the header's call number
    try:  # (the fused kernel launches even with no tokens: its header tells the peers this rank's call)
        impl.fn(a.q, a.k, a.q_weight, a.k_weight, a.eps, a.weight_offset, a.rounding, a.group)
    except Exception as error:  # counted, maybe not launched: out of step with the peers, who give up on it
        tp_workspace.fail(a.group, f"tp_qk_norm: rank {dist.get_rank(a.group)} failed to launch a fused call "
                                   f"({type(error).__name__}: {error}); the group is out of step, so every later "
                                   f"tp_qk_norm call on it raises: create a new process group")
        raise


def _abstain(group, backend: str) -> None:
    """This rank rejected its call: take part anyway, on the path its peers take, saying so (the
    fused kernel's absent header, or the host exchange's rejected flag), so that they raise
    instead of waiting and every rank stays in step. Nothing where there is no group to tell (or
    under torch.compile, whose tracing runs the checks on every rank alike)."""
    if torch.compiler.is_compiling() or backend not in C.BACKENDS:
        return
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup) or dist.get_world_size(group) == 1:
        return
    from cookbook import tp_workspace

    if tp_workspace.failure(group):
        return
    try:
        on_gpu = dist.get_backend(group) == "nccl"
        fused = on_gpu and backend in ("auto", "cuda") and is_fused(registry.fastest(tp_contract.OP))
        if fused:  # the peers decide as resolve_tp does: the kernels built, then the workspace
            from cookbook import cuda

            cuda.TpOps(cuda.tp_tuned())
            fused = tp_workspace.unavailable(group) is None
        if fused:
            tp_workspace.abstain(group, cuda.tp_absent)
        else:
            tp_contract.check_ranks_agree(None, group=group, wait_limit_s=tp_workspace.state(group).wait_limit_s)
    except Exception as error:  # noqa: BLE001 - the rank's own error is the one to raise; the group is lost
        tp_workspace.fail(group, f"tp_qk_norm: rank {dist.get_rank(group)} rejected a call and could not tell its "
                                 f"peers ({type(error).__name__}: {error}); the group is out of step, so every later "
                                 f"tp_qk_norm call on it raises: create a new process group")


def _run_tp_qk_norm_by_group_name(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                                  eps: float, weight_offset: float, rounding: str, backend: str,
                                  group_name: str) -> None:
    group = dist.distributed_c10d._resolve_process_group(group_name)
    _run_tp_qk_norm(tp_contract.TPQKNormArgs(q, k, q_weight, k_weight, eps, weight_offset, rounding, group), backend)


_tp_qk_norm_op = _as_op("tp_qk_norm_dispatch", _run_tp_qk_norm_by_group_name,
                        lambda q, k, q_weight, k_weight, *_: tp_contract.check_in_place(q, k, q_weight, k_weight))

FIRST_FUSED_VERSION = 2  # tp_qk_norm's cuda_v1 is the three-launch NCCL pipeline; v2 on, one kernel per call

# Where the fused kernel cannot run, "auto" and "cuda" take the NCCL path with rung 1's kernels
# from the tuned extension (so that no other extension is built).
NCCL_FALLBACK = registry.Impl("tp_qk_norm", "cuda_tuned_nccl", "tuned", 0, "cookbook.cuda:tp_qk_norm_nccl",
                              "the tuned extension's NCCL path: rung 1's sum-of-squares kernel, the all-reduce, "
                              "its apply kernel", kernel="tp_qk_norm/tuned.cuh")


def is_fused(impl) -> bool:
    """Whether a tp_qk_norm implementation is the fused kernel (one launch, symmetric memory)."""
    if impl.target != "cookbook.cuda:tp_qk_norm":
        return False
    return impl.level == "tuned" or (impl.level == "cuda" and impl.version >= FIRST_FUSED_VERSION)


@functools.cache
def _say_fallback(reason: str) -> None:
    warnings.warn(f"tp_qk_norm: the fused kernel cannot run here ({reason}); using the NCCL path (cuda_v1's kernels)",
                  RuntimeWarning, stacklevel=5)


def resolve_tp(backend: str, a: tp_contract.TPQKNormArgs):
    """The tp_qk_norm implementation `backend` names. On CUDA, "auto" and "cuda" take the fused
    kernel when every rank's GPU can write into every other's memory (one node, P2P/NVLink), else
    the NCCL pipeline cuda_v1, and say so once. The decision is made once per group,
    collectively, so every rank takes the same path. The kernels are built before the group's
    workspace is created: that creation ends in a barrier, so a rank that builds for minutes
    does not leave its peers' first launch waiting."""
    device = a.q.device
    if backend == "auto" and device.type != "cuda":
        return registry.latest("tp_qk_norm", "reference")
    impl = registry.resolve("tp_qk_norm", "cuda" if backend == "auto" else backend, device)
    if is_fused(impl):
        from cookbook import cuda, tp_workspace

        cuda.TpOps(impl.extension)
        reason = tp_workspace.unavailable(a.group)
        if reason:
            _say_fallback(reason)
            return NCCL_FALLBACK if impl.level == "tuned" else registry.get("tp_qk_norm", "cuda_v1")
    return impl


def raise_pending_errors(group=None) -> None:
    """Raise what this rank's group recorded, if any: a failure that ended the group (every later
    call raises it), or, once, what an earlier fused launch reported (ranks that disagreed, a peer
    that did not take part). The fused path runs it at the start of every call; call it after
    `torch.cuda.synchronize()` to check the last call."""
    from cookbook import tp_workspace

    tp_workspace.raise_pending_errors(group)


virtual_tp = tp_contract.virtual_tp

for _op in (qk_norm, cross_head_norm, qk_norm_rope, qk_norm_rope_cache, tp_qk_norm):
    _op.__doc__ = _op.__doc__.replace("{backends}", _BACKENDS_DOC)
