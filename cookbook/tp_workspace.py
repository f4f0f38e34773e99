"""`tp_qk_norm`'s state per process group: the fused kernel's workspace, the wait limit, and the
failures that end a group's use.

Each rank allocates one buffer of 64-bit words with PyTorch's symmetric memory
(`torch.distributed._symmetric_memory`), and the rendezvous hands every rank the addresses of
every peer's buffer, mapped into its own address space (CUDA IPC over NVLink/P2P). The fused
kernel (kernels_cuda/tp_qk_norm/, v2 on) then *stores* its partial sums straight into the
peers' buffers: no NCCL call, no extra launch. Multicast (NVLS) is never used.

Buffer layout, per rank (words of 64 bits; `world` = the group's size)::

    header[parity][source rank][HEADER_WORDS]           the source's call: HEADER_FIELDS below
    slots [parity][capacity tokens][2 tensors][source rank]   the source's partial sum_sq

Every word is ``(epoch << 32) | payload`` (a float's bits, or a count). The epoch is the call
number, kept in device memory (`counters`) and advanced by the kernel, so CUDA-graph replays
advance it too. A reader waits until a word's tag equals the current epoch: a tag cannot
collide with stale data (there is no sentinel value that real data could take), and no barrier or
reset kernel runs between calls. Two parities suffice: a rank can be at most one call ahead of a
peer (it cannot finish call n+1 without the peer's call-n+1 sums), so call n+2, the next writer
of parity n % 2, starts only after every rank has finished reading call n. Epochs skip 0 (the
value of a fresh buffer) and wrap from 2^32 - 1 to 2, keeping the parities alternating; the last
two launches before the wrap zero the half of their own buffer they used, so no stale word can
carry a tag that looks current after it. A call longer than `capacity` tokens runs as several
launches (chunks), one epoch each; when a chunk fails, the later chunks (which the peers may not
have) do nothing and leave the epoch alone.

Agreement, at no extra round trip: every launch publishes its call's header (the token count,
the shard widths, eps, weight_offset, and a word for the dtype, the rounding, the weights'
storage, the version and the group's call count) and compares every rank's with its own before it
writes anything, beside the wait for the sums. Ranks that disagree on any of it leave their shards
untouched and record the first difference in the workspace's counters (device memory) and a
status word (pinned host memory) that `raise_pending_errors` reads at the next call. A rank that
rejects its own arguments still launches once with an *absent* header (`abstain`), so its peers are
not left waiting and the epochs stay in step; every rank counts every call, a rejected one too, so
ranks whose sequences of calls differ (a rank that left a call without launching anything) differ
in every later header instead of computing with another call's sums.

Bounded waits: a CTA waits for every rank's header at most the group's wait limit (`wait_limit_s`,
default DEFAULT_WAIT_LIMIT_S) after it started; a header that does not come by then makes the rank
give up on the call (it writes nothing and reports), and every later launch of the rank gives up at
once on a missing header. The waits for partial sums are not bounded themselves: they run beside or
after the check of the same ranks' headers, so a rank that never makes the call stops them; once
every header has come, every rank is in the launch and pushes its sums (a rank that dies inside the
kernel is left to the process group's own timeout). A rank that gave up is out of step with its
peers for good: every later tp_qk_norm call on the group raises (`failure`).

Availability is decided once per group, collectively (every rank takes the same path): one node,
NCCL, every pair of GPUs P2P-capable, and a successful rendezvous.
"""

from __future__ import annotations

import math
import os
import socket
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist

PARITIES = 2
NUM_TENSORS = 2
MAX_RANKS = 8  # the kernel's peer-pointer array (one node)
# Tokens per launch; longer calls run as several launches (chunks) of one kernel. 2 parities x
# 32768 tokens x 2 tensors x 8 bytes = 1 MiB per rank of the group.
CAPACITY_TOKENS = int(os.environ.get("COOKBOOK_TP_CAPACITY_TOKENS", 32768))
FIRST_EPOCH = 1

# The header (kHeader* in the kernel header, which tests/test_tp_qk_norm.py compares with these).
HEADER_FIELDS = ("tokens", "shard widths", "eps", "weight_offset", "math")
HEADER_WORDS = len(HEADER_FIELDS)
TOKENS, WIDTHS, EPS, WEIGHT_OFFSET, MATH = range(HEADER_WORDS)
WIDTH_SHIFT = 16  # WIDTHS: (q shard width / 2) << 16 | (k shard width / 2)
# MATH: dtype (2 bits), rounding == "hf", each weight in float32, the implementation (8 bits: a rung's number, 0 tuned), the call number (16 bits)
MATH_DTYPE_SHIFT, MATH_HF_BIT, MATH_Q_WEIGHT_FP32_BIT, MATH_K_WEIGHT_FP32_BIT = 0, 2, 3, 4
MATH_VERSION_SHIFT, MATH_CALL_SHIFT = 8, 16
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # the kernel's DType codes 0, 1, 2
ABSENT = 0xFFFFFFFF  # every header word of a rank that does not take part in the call

# counters: int32 device words (kEpochCounter ... kReportEpoch)
COUNTER_NAMES = ("epoch", "done", "failed epoch", "gave up", "wait limit", "report what", "report theirs",
                 "report ours", "report epoch")
(EPOCH_COUNTER, DONE_COUNTER, FAILED_COUNTER, GAVE_UP_COUNTER, WAIT_LIMIT_COUNTER, REPORT_WHAT, REPORT_THEIRS,
 REPORT_OURS, REPORT_EPOCH) = range(len(COUNTER_NAMES))
COUNTER_WORDS = len(COUNTER_NAMES)
MISMATCH, GAVE_UP = 1, 2  # REPORT_WHAT: kind | peer << 4 | header word << 8
REPORT_PEER_SHIFT, REPORT_WORD_SHIFT = 4, 8
TICK_NS = 1 << 10  # the kernel's clock for the wait limit
# status: int64 pinned host words: 1 once a report waits in the counters; the group's call count
STATUS_REPORT, STATUS_CALL_NUMBER = 0, 1
STATUS_WORDS = 2

# How long any wait of the op may last before the rank gives up: longer than any skew between the
# ranks of a working engine (builds and the workspace's creation happen before the first call's
# barrier), far shorter than a process group's own timeout (10 to 30 minutes) would leave a GPU
# spinning or a host blocked. tp_workspace.set_wait_limit changes it per group.
DEFAULT_WAIT_LIMIT_S = float(os.environ.get("COOKBOOK_TP_WAIT_LIMIT_S", 120.0))
MAX_WAIT_LIMIT_S = (2**31 - 1) * TICK_NS / 1e9  # the kernel's limit is an int32 of ticks (36 minutes)


@dataclass
class Workspace:
    buffer: torch.Tensor  # this rank's symmetric buffer (int64 words)
    handle: object  # the rendezvous handle (keeps the peers' mappings alive)
    peer_buffers: list  # device addresses of every rank's buffer, as mapped in this process
    counters: torch.Tensor  # int32 [COUNTER_WORDS], on this rank's GPU
    status: torch.Tensor  # int64 [STATUS_WORDS], pinned host memory (the kernel and the binding read and write it)
    rank: int
    world: int
    capacity: int

    @property
    def status_words(self):
        """The status words as a numpy view: reads and writes of plain host memory, no torch op."""
        return self.status.numpy()


@dataclass
class GroupState:
    """What this rank knows about a group, whatever the path: the wait limit, and the failure
    that ended the group's use for tp_qk_norm (every later call raises it)."""

    wait_limit_s: float
    failure: str | None = None
    calls: int = 0  # the fused path's calls on this group, rejected ones included (the header's call number)


_workspaces: dict = {}  # group name -> Workspace, or the reason the fused kernel cannot run
_states: dict = {}  # group name -> GroupState


def buffer_words(world: int, capacity: int = CAPACITY_TOKENS) -> int:
    return PARITIES * world * HEADER_WORDS + PARITIES * capacity * NUM_TENSORS * world


def _key(group) -> str:
    return group.group_name


def state(group) -> GroupState:
    found = _states.get(_key(group))
    if found is None:
        found = _states[_key(group)] = GroupState(DEFAULT_WAIT_LIMIT_S)
    return found


def _limit_ticks(seconds: float) -> int:
    return max(1, min(2**31 - 1, int(seconds * 1e9 / TICK_NS)))


def set_wait_limit(group, seconds: float) -> None:
    """This rank's wait limit on `group` (every path: the fused kernel's waits and the host
    paths' exchange). Call it on every rank; it is not collective."""
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and 0 < seconds <= MAX_WAIT_LIMIT_S):
        raise ValueError(f"seconds: expected a wait limit in (0, {MAX_WAIT_LIMIT_S:.0f}], got {seconds!r}")
    state(group).wait_limit_s = float(seconds)
    found = _workspaces.get(_key(group))
    if isinstance(found, Workspace):
        found.counters[WAIT_LIMIT_COUNTER] = _limit_ticks(seconds)  # stream-ordered: the next launch sees it


def fail(group, message: str) -> None:
    """End the group's use on this rank: every later tp_qk_norm call on it raises `message`."""
    state(group).failure = message


def failure(group) -> str | None:
    found = _states.get(_key(group))
    return found.failure if found else None


# --------------------------------------------------------------------------------------------
# The header, as the kernel writes it (call_header in kernels_cuda/tp_qk_norm/params.h), and in words.
# --------------------------------------------------------------------------------------------
def float_bits(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0]


def bits_float(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def header(tokens, q_width, k_width, eps, weight_offset, dtype, rounding, q_weight_dtype, k_weight_dtype,
           version, call_number=0) -> tuple:
    """The HEADER_WORDS payloads of a call: what every rank publishes and compares."""
    math_word = (DTYPES.index(dtype) << MATH_DTYPE_SHIFT | (rounding == "hf") << MATH_HF_BIT
                 | (q_weight_dtype == torch.float32) << MATH_Q_WEIGHT_FP32_BIT
                 | (k_weight_dtype == torch.float32) << MATH_K_WEIGHT_FP32_BIT | version << MATH_VERSION_SHIFT
                 | (call_number & 0xFFFF) << MATH_CALL_SHIFT)
    return (tokens, (q_width // 2) << WIDTH_SHIFT | k_width // 2, float_bits(eps), float_bits(weight_offset), math_word)


def _implementation_name(number: int) -> str:
    """The header's implementation (params.h): a rung's number, 0 for the tuned kernel."""
    return "cuda_tuned" if number == 0 else f"cuda_v{number}"


def _math_fields(word: int) -> dict:
    return {"dtype": DTYPES[word >> MATH_DTYPE_SHIFT & 3], "rounding": "hf" if word >> MATH_HF_BIT & 1 else "fused",
            "q_weight_shard dtype": "float32" if word >> MATH_Q_WEIGHT_FP32_BIT & 1 else "the activation dtype",
            "k_weight_shard dtype": "float32" if word >> MATH_K_WEIGHT_FP32_BIT & 1 else "the activation dtype",
            "backend": _implementation_name(word >> MATH_VERSION_SHIFT & 0xFF), "call": word >> MATH_CALL_SHIFT}


def differing_field(word: int, ours: int, theirs: int) -> tuple[str, str, object, object]:
    """(argument, what, our value, their value) of the first field in which two payloads of header
    word `word` differ, for an error message."""
    if word == TOKENS:
        return "q_shard", "tokens", ours, theirs
    if word == WIDTHS:
        (oq, ok), (tq, tk) = ((2 * (v >> WIDTH_SHIFT), 2 * (v & 0xFFFF)) for v in (ours, theirs))
        return ("q_shard", "shard width", oq, tq) if oq != tq else ("k_shard", "shard width", ok, tk)
    if word in (EPS, WEIGHT_OFFSET):  # float32 bits: shown to float32's precision
        name = HEADER_FIELDS[word]
        return name, name, f"{bits_float(ours):.7g}", f"{bits_float(theirs):.7g}"
    mine, other = _math_fields(ours), _math_fields(theirs)
    field = next(name for name in mine if mine[name] != other[name])
    argument, what = {"dtype": ("q_shard", "dtype"), "rounding": ("rounding", "rounding"),
                      "backend": ("backend", "implementation"),
                      "call": ("tp_qk_norm", "sequence of calls (a call number, modulo 2^16)")}.get(
        field, (field.split()[0], "dtype (float32 or the activation dtype)"))
    return argument, what, mine[field], other[field]


# --------------------------------------------------------------------------------------------
# The workspace: created once per group, collectively.
# --------------------------------------------------------------------------------------------
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
            counters = torch.zeros(COUNTER_WORDS, dtype=torch.int32, device=device)
            counters[EPOCH_COUNTER] = FIRST_EPOCH
            counters[WAIT_LIMIT_COUNTER] = _limit_ticks(state(group).wait_limit_s)
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


def count_call(group) -> None:
    """Count a fused call on `group` (every rank counts every call, a rejected one too): the launch's
    header carries the count, so ranks whose sequences of calls differ find out."""
    st = state(group)
    st.calls += 1
    _workspaces[_key(group)].status_words[STATUS_CALL_NUMBER] = st.calls


def abstain(group, launch_absent) -> None:
    """This rank's launch for a call it does not take part in (it rejected its arguments): the
    fused protocol's absent header, so that the peers write nothing, report it, and are not left
    waiting. Only where the group's fused workspace exists; `launch_absent(workspace)` launches it
    (`cookbook.cuda.tp_absent`, from the tuned kernels)."""
    ws = _workspaces.get(_key(group))
    if not isinstance(ws, Workspace):
        return
    count_call(group)
    launch_absent(ws)


# --------------------------------------------------------------------------------------------
# Reports: what the kernel recorded, raised at the next call.
# --------------------------------------------------------------------------------------------
def _read_report(ws: Workspace) -> list | None:
    """The report words (counters REPORT_WHAT .. REPORT_EPOCH), consumed; None under CUDA-graph
    capture, which cannot read them (the error then aborts the capture, and the next call outside
    it reads them). Waits for the GPU first: bounded, since every header wait of a launch is."""
    if ws.counters.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            return None
        torch.cuda.synchronize(ws.counters.device)
    words = [v & 0xFFFFFFFF for v in ws.counters[REPORT_WHAT:REPORT_EPOCH + 1].tolist()]  # int32 -> the uint32 bits
    ws.counters[REPORT_WHAT:REPORT_EPOCH + 1] = 0
    ws.status_words[STATUS_REPORT] = 0
    return words


def _message(ws: Workspace, words: list | None, group) -> tuple[type, str, bool]:
    """(exception type, message, whether it ends the group) of a report."""
    if words is None:
        return RuntimeError, ("tp_qk_norm: an earlier fused call on this group failed; its report is read outside "
                              "CUDA-graph capture (the next call outside it raises it)"), False
    what, theirs, ours, epoch = words
    kind, peer, word = what & 0xF, what >> REPORT_PEER_SHIFT & 0xF, what >> REPORT_WORD_SHIFT & 0xF
    if kind == GAVE_UP:
        return RuntimeError, (
            f"tp_qk_norm: rank {ws.rank} gave up waiting for rank {peer}'s header of fused launch {epoch} after "
            f"{state(group).wait_limit_s:g} s (the group's wait limit; tp_workspace.set_wait_limit) on group "
            f"{_key(group)!r} (tp={ws.world}): that rank left the call early, never made it, or ran another path. The "
            f"call wrote nothing; the ranks are out of step, so every later tp_qk_norm call on this group raises: "
            f"create a new process group"), True
    if theirs == ABSENT:
        return RuntimeError, (
            f"tp_qk_norm: rank {peer} did not take part in an earlier fused call of the group (tp={ws.world}; "
            f"launch {epoch}): it rejected its arguments (its own error says why). That call left every shard on "
            f"rank {ws.rank} unmodified"), False
    argument, what_differs, mine, other = differing_field(word, ours, theirs)
    return ValueError, (
        f"{argument}: expected the same {what_differs} on every rank of the group (tp={ws.world}); an earlier fused "
        f"tp_qk_norm call had {mine} on rank {ws.rank} and {other} on rank {peer}: it left every shard of that "
        f"call unmodified"), False


def raise_pending_errors(group=None) -> None:
    """Raise the failure this rank's group recorded, if any: the group's end (every later call),
    or, once, what an earlier fused launch reported (a disagreement, or a wait that gave up, which
    also ends the group)."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return
        group = dist.group.WORLD
    ended = failure(group)
    if ended:
        raise RuntimeError(ended)
    found = _workspaces.get(_key(group))
    if not isinstance(found, Workspace) or not found.status_words[STATUS_REPORT]:  # every call: a plain memory read
        return
    error, message, ends_group = _message(found, _read_report(found), group)
    if ends_group:
        fail(group, message)
    raise error(message)
