"""The fused `tp_qk_norm` kernel's workspace: peer-writable buffers, one per process group.

Each rank allocates one buffer of 64-bit words with PyTorch's symmetric memory
(`torch.distributed._symmetric_memory`), and the rendezvous hands every rank the addresses of
every peer's buffer, mapped into its own address space (CUDA IPC over NVLink/P2P). The fused
kernel (kernels_cuda/tp_qk_norm.cuh, v2) then *stores* its partial sums straight into the peers'
buffers: no NCCL call, no extra launch. Multicast (NVLS) is never used.

Buffer layout, per rank (words of 64 bits; `world` = the group's size)::

    header[parity][source rank][HEADER_WORDS]           T, q and k shard widths of the source's call
    slots [parity][capacity tokens][2 tensors][source rank]   the source's partial sum_sq

Every word is ``(epoch << 32) | payload`` (a float's bits, or a count). The epoch is the call
number, kept in device memory (`counters`) and advanced by the kernel's last CTA, so CUDA-graph
replays advance it too. A reader waits until a word's tag equals the current epoch: a tag cannot
collide with stale data (there is no sentinel value that real data could take), and no barrier or
reset kernel runs between calls. Two parities suffice: a rank can be at most one call ahead of a
peer (it cannot finish call n+1 without the peer's call-n+1 sums), so call n+2, the next writer
of parity n % 2, starts only after every rank has finished reading call n. Epochs skip 0 (the
value of a fresh buffer) and wrap from 2^32 - 1 to 2, keeping the parities alternating; the last
two launches before the wrap zero the half of their own buffer they used, so no stale word can
carry a tag that looks current after it. A call longer than `capacity` tokens runs as several
launches (chunks), one epoch each; when the first chunk finds the ranks disagreeing, the later
chunks (which the peers may not have) do nothing and leave the epoch alone.

Rank agreement: every call also publishes its token count and shard widths in the header; the
kernel compares all ranks' headers before waiting on any sum, so ranks that disagree finish
(leaving their shards untouched) and record the mismatch in `status`, a pinned host word that
`raise_pending_errors` turns into an exception at the next call.

Availability is decided once per group, collectively (every rank takes the same path): one node,
NCCL, every pair of GPUs P2P-capable, and a successful rendezvous.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

PARITIES = 2
NUM_TENSORS = 2
HEADER_WORDS = 3  # tokens, q shard width, k shard width
HEADER_NAMES = ("tokens", "q_shard width", "k_shard width")
MAX_RANKS = 8  # the kernel's peer-pointer array (one node)
# Tokens per launch; longer calls run as several launches (chunks) of one kernel. 2 parities x
# 32768 tokens x 2 tensors x 8 bytes = 1 MiB per rank of the group.
CAPACITY_TOKENS = int(os.environ.get("COOKBOOK_TP_CAPACITY_TOKENS", 32768))
# status words (pinned host memory the kernel writes): flag, peer rank, header word, peer's value, ours
STATUS_WORDS = 5
COUNTER_WORDS = 3  # epoch, CTAs done, the epoch of an abandoned call's later chunks (device memory, int32)
FIRST_EPOCH = 1


@dataclass
class Workspace:
    buffer: torch.Tensor  # this rank's symmetric buffer (int64 words)
    handle: object  # the rendezvous handle (keeps the peers' mappings alive)
    peer_buffers: list  # device addresses of every rank's buffer, as mapped in this process
    counters: torch.Tensor  # int32 [epoch, CTAs done], on this rank's GPU
    status: torch.Tensor  # int64 [STATUS_WORDS], pinned host memory the kernel writes
    rank: int
    world: int
    capacity: int


_workspaces: dict = {}  # group name -> Workspace, or the reason the fused kernel cannot run


def buffer_words(world: int, capacity: int = CAPACITY_TOKENS) -> int:
    return PARITIES * world * HEADER_WORDS + PARITIES * capacity * NUM_TENSORS * world


def _key(group) -> str:
    return group.group_name


def _p2p_reason(group) -> str | None:
    """Why this group's GPUs cannot write into each other's memory, or None. Collective."""
    if dist.get_backend(group) != "nccl":
        return f"the group's backend is {dist.get_backend(group)!r}, not 'nccl'"
    world = dist.get_world_size(group)
    if world > MAX_RANKS:
        return f"the group has {world} ranks; the kernel takes at most {MAX_RANKS} (one node)"
    mine = (socket.gethostname(), torch.cuda.current_device())
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    if len({host for host, _ in everyone}) > 1:
        return "the ranks are on more than one node"
    devices = [d for _, d in everyone]
    for a in devices:
        for b in devices:
            if a != b and not torch.cuda.can_device_access_peer(a, b):
                return f"GPU {a} cannot access GPU {b} (no P2P)"
    return None


def _create(group) -> Workspace | str:
    """Allocate and rendezvous; every rank of `group` calls it (collective)."""
    reason = _p2p_reason(group)
    workspace = None
    device = torch.device("cuda", torch.cuda.current_device())
    if reason is None:
        try:
            from torch.distributed import _symmetric_memory as symm_mem

            world = dist.get_world_size(group)
            # Chunks must line up across ranks: every rank takes the smallest capacity asked for.
            capacity = torch.tensor([CAPACITY_TOKENS], dtype=torch.int64, device=device)
            dist.all_reduce(capacity, op=dist.ReduceOp.MIN, group=group)
            capacity = int(capacity.item())
            buffer = symm_mem.empty(buffer_words(world, capacity), dtype=torch.int64, device=device)
            buffer.zero_()  # epoch 0 never matches: a fresh buffer holds no call's data
            handle = symm_mem.rendezvous(buffer, group)
            counters = torch.tensor([FIRST_EPOCH] + [0] * (COUNTER_WORDS - 1), dtype=torch.int32, device=device)
            status = torch.zeros(STATUS_WORDS, dtype=torch.int64).pin_memory()
            workspace = Workspace(buffer, handle, [int(p) for p in handle.buffer_ptrs], counters, status,
                                  dist.get_rank(group), world, capacity)
        except Exception as error:  # noqa: BLE001 - any failure means: take the NCCL path
            reason = f"symmetric memory rendezvous failed: {type(error).__name__}: {error}"
    # Every rank must take the same path: agree on the least capable rank's answer.
    ok = torch.tensor([0 if reason else 1], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    if not ok.item():
        return reason or "another rank of the group cannot use symmetric memory"
    torch.cuda.synchronize()  # the zeroed buffer is in place ...
    dist.barrier(group=group)  # ... on every rank before any rank's kernel writes into it
    return workspace


def unavailable(group) -> str | None:
    """None when the fused kernel can run on `group` (creating its workspace on first use:
    collective), else the reason."""
    found = _workspaces.get(_key(group))
    if found is None:
        found = _workspaces[_key(group)] = _create(group)
    return found if isinstance(found, str) else None


def get(group) -> Workspace:
    reason = unavailable(group)
    if reason:
        raise RuntimeError(f"tp_qk_norm: the fused kernel cannot run on this group: {reason}")
    return _workspaces[_key(group)]


def raise_pending_errors(group=None) -> None:
    """Raise (once) the rank mismatch an earlier fused call recorded, if any."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        group = dist.group.WORLD
    found = _workspaces.get(_key(group))
    if not isinstance(found, Workspace) or not found.status.numpy()[0]:  # every call: a plain memory read
        return
    _, peer, word, theirs, ours = found.status.tolist()
    found.status.zero_()
    raise ValueError(
        f"q_shard: expected the same {HEADER_NAMES[word]} on every rank of the group (tp={found.world}); an earlier "
        f"fused tp_qk_norm call had {ours} on rank {found.rank} and {theirs} on rank {peer}: it left every shard "
        f"of that call unmodified")
