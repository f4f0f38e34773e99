# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # `tp_qk_norm`: a cross-head norm split over tensor-parallel GPUs, and what must cross them
#
# The third op of the cookbook is `cross_head_norm` (notebook 02) under **tensor parallelism**:
# every GPU holds only a column shard of q and k, yet the statistic is taken over the full row.
# The lesson of this op is **communication**: how little has to cross the GPUs (two floats per
# token), where the eps must go when the statistic is assembled from pieces, and how one fused
# kernel can exchange those floats through peer memory without a collective library, a barrier
# or a reset kernel, and still never hang.
#
# The order: the problem and the identity that makes it cheap, the bytes that cross the GPUs,
# the per-rank algorithm and the contract's helpers, *virtual TP* (the sharded algorithm on one
# device) against `cross_head_norm`, the eps pitfall with a deliberately wrong implementation,
# the implementations, the fused kernel's protocol with a small pure-Python simulation of ranks
# exchanging tagged words, and the real 2-GPU numbers when they have been recorded.
#
# It runs top to bottom on a laptop in seconds: everything here runs in one process (the real op
# is a collective over several GPUs, which `python -m cookbook bench --ops tp_qk_norm` runs under
# torchrun). Every number printed below is computed here; the code shown is read from the tested
# sources, never pasted. The first cell is every notebook's (`cookbook/walkthrough.py`: Numba's
# CUDA simulator switched on where there is no GPU, before anything imports Numba).

# %%
import sys
from pathlib import Path

# Run from a checkout (e.g. `notebooks/`): make its packages importable, whether installed or not.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cookbook" / "walkthrough.py").is_file()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cookbook import walkthrough  # imports neither Numba nor a CUDA extension

session = walkthrough.setup("tp_qk_norm")  # without a GPU: NUMBA_ENABLE_CUDASIM=1, before anything imports Numba
DEVICE, ON_GPU = session.device, session.on_gpu

# %%
import inspect
import random
import struct

import torch

import cookbook
from cookbook import registry, tp_workspace
from cookbook.ops import cross_head_norm as cross
from cookbook.testing import agreement

OP = "tp_qk_norm"
contract = registry.contract(OP)  # the contract module cookbook/ops/tp_qk_norm.py
EPS = 1e-6
Q_WIDTH, K_WIDTH = 6144, 1024  # MiniMax-M2: q and k normalized over their full widths
torch.set_printoptions(precision=6, linewidth=120)

# %% [markdown]
# ## 1. The problem: a statistic over columns that live on different GPUs
#
# MiniMax-M2 normalizes q over its **full** width (6144) and k over its full width (1024), the
# cross-head norm of notebook 02. Under tensor parallelism the q, k and v projections are split
# by columns: with `tp` ranks, rank `r` holds `[T, 6144 / tp]` of q, `[T, 1024 / tp]` of k and
# the matching slices of the two norm weights. No rank holds a whole row, so no rank can compute
# `mean(x^2)` over it alone.
#
# The naive fix (the first thing engines did) is to all-gather the shards, normalize the
# gathered rows and keep one's own columns: the whole activation crosses the GPUs. But the
# statistic is a sum, and a sum splits over the shards. For a token row `x` cut into shards
# `x_0 .. x_{tp-1}`:
#
# ```
# sum(x^2) = sum over ranks r of sum(x_r^2)
# ```
#
# so each rank computes **two floats per token** (its shard's sum of squares of q and of k), the
# ranks all-reduce those `[T, 2]` floats, and each rank normalizes its own shard with the full
# width in the mean and its own weight slice:
#
# ```
# rstd = rsqrt(total_sum_sq / full_width + eps)      (0 where that is 0)
# y_r  = x_r * rstd * (w_r + weight_offset)
# ```
#
# The contract module's docstring, printed from the source:

# %%
print(contract.__doc__)

# %% [markdown]
# ## 2. What crosses the GPUs
#
# Per rank and per call, in bf16, for MiniMax-M2's widths. The all-gather baseline receives the
# other `tp - 1` ranks' shards of q and k. The sum-of-squares exchange needs two float32 values
# per token from each peer; the fused kernel (section 7) sends each as one 8-byte word (the float
# plus a 32-bit tag), so its wire traffic is twice the payload. Both directions are the same size.

# %%
BF16_BYTES, F32_BYTES, WORD_BYTES = 2, 4, 8


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


print(f"{'tp':>3} {'tokens':>7} | {'all-gather (received)':>22} | {'sums: payload':>14} | "
      f"{'fused: tagged words':>20} | all-gather / fused")
for tp in (2, 4, 8):
    for tokens in (1, 128, 16384):
        gathered = (tp - 1) * tokens * (Q_WIDTH + K_WIDTH) // tp * BF16_BYTES
        payload = (tp - 1) * tokens * contract.NUM_TENSORS * F32_BYTES
        wire = (tp - 1) * tokens * contract.NUM_TENSORS * WORD_BYTES
        print(f"{tp:>3} {tokens:>7} | {human(gathered):>22} | {human(payload):>14} | {human(wire):>20} | "
              f"{gathered / wire:8.0f}x")

# %% [markdown]
# The all-gather moves `(tp - 1) / tp` of the whole `(6144 + 1024)`-wide activation into every
# rank, and that share grows with tp while each rank's own shard shrinks. The sums are two orders
# of magnitude smaller at every shape (the ratio, `(6144 + 1024) x 2 / tp` bytes of shard per
# token against 16 bytes of tagged words, does not depend on T), and at one token they are a
# handful of bytes: at decode sizes the exchange is pure **latency**, which is why the fused
# kernel avoids a separate collective launch altogether.
#
# What one rank must still move through its own memory, the contract's `bytes_moved` (shards
# read and written once, weight shards once, plus the sums it sends):

# %%
def meta_shard(tokens, tp, dtype=torch.bfloat16):
    empty = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    return dict(q=empty(tokens, Q_WIDTH // tp), k=empty(tokens, K_WIDTH // tp), q_weight=empty(Q_WIDTH // tp),
                k_weight=empty(K_WIDTH // tp))


for tp in (2, 4, 8):
    print(f"tp={tp}: " + ", ".join(f"T={t}: {human(contract.bytes_moved(**meta_shard(t, tp), tp=tp))}"
                                   for t in (1, 128, 16384)))

# %% [markdown]
# ## 3. One rank's view: the reference, and the contract's helpers
#
# The reference is three steps with one collective: `local_sum_sq` (this shard's `[T, 2]`
# sums), `all_reduce_sum` (a `torch.distributed.all_reduce`), `apply_sum_sq` (normalize the
# shard with the full widths). From the tested source:

# %%
for fn in (contract.local_sum_sq, contract.apply_sum_sq, contract.reference):
    print(inspect.getsource(fn))

# %% [markdown]
# The test helpers build **full** inputs from a seed (every rank draws the same ones), cut out
# one rank's shards exactly as a rank holds them (`shard_of`: q and k as views into one fused
# qkv shard), and slice the float64 expected value of the full row (`expected`). Here four
# "ranks" live in this process as separate tensors, and the all-reduce is a sum of their `[T, 2]`
# partials; each rank's result is checked against its slice of the full row's exact value:

# %%
TP = 4
full = contract.make_full_inputs(5, 256, 64, torch.bfloat16, DEVICE, seed=3)
ranks = [contract.shard_of(full, r, TP) for r in range(TP)]
print(f"full q {tuple(full['q'].shape)}, k {tuple(full['k'].shape)}; rank 0 holds q_shard "
      f"{tuple(ranks[0]['q_shard'].shape)} stride {ranks[0]['q_shard'].stride()}, k_shard "
      f"{tuple(ranks[0]['k_shard'].shape)}, weights {tuple(ranks[0]['q_weight_shard'].shape)}, "
      f"{tuple(ranks[0]['k_weight_shard'].shape)}")

partials = [contract.local_sum_sq(s["q_shard"], s["k_shard"]) for s in ranks]  # what each rank computes
sum_sq = torch.stack(partials).sum(0)  # what the all-reduce hands every rank
print(f"token 0: partial sums (q, k) per rank {[tuple(round(v, 3) for v in p[0].tolist()) for p in partials]}"
      f" -> total {tuple(round(v, 3) for v in sum_sq[0].tolist())}")
print(f"         full-row sums (q, k)            {full['q'][0].float().square().sum().item():.3f}, "
      f"{full['k'][0].float().square().sum().item():.3f}\n")

for r, s in enumerate(ranks):
    contract.apply_sum_sq(s["q_shard"], s["k_shard"], s["q_weight_shard"], s["k_weight_shard"], sum_sq,
                          full["q"].shape[1], full["k"].shape[1], EPS, 0.0, "fused")
    want = contract.expected(full, r, TP, EPS, 0.0, "fused")
    verdicts = [agreement(n, s[n], exact, hf, "fused", contract.TOLERANCES[torch.bfloat16])
                for n, (exact, hf) in want.items()]
    print(f"rank {r}: " + "; ".join(v.message for v in verdicts))

# %% [markdown]
# ## 4. Virtual TP: the sharded algorithm on one device equals `cross_head_norm`
#
# `virtual_tp` runs the same algorithm on full tensors in one process: it cuts the columns into
# `tp` shards, computes each shard's sums on its own, sums them (the all-reduce) and normalizes
# each shard with its weight slice. Only the order of the float32 partial sums differs from the
# single-GPU `cross_head_norm`, so the outputs agree to within rounding. Below, at MiniMax-M2's
# widths, for tp = 1, 2, 4, 8 on the same inputs: the distance in ulps from `cross_head_norm`'s
# reference (and the share of bit-identical elements), and the agreement with the contract
# (float64 value for `"fused"`, Hugging Face-order reference for `"hf"`).

# %%
VTP_TOKENS = 512 if ON_GPU else 16


def full_inputs(dtype):
    return contract.make_full_inputs(VTP_TOKENS, Q_WIDTH, K_WIDTH, dtype, DEVICE, seed=7)


for dtype, rounding in ((torch.bfloat16, "fused"), (torch.bfloat16, "hf"), (torch.float32, "fused")):
    tol = contract.TOLERANCES[dtype]
    single = full_inputs(dtype)
    want = cross.expected(single, EPS, 0.0, rounding)
    cookbook.cross_head_norm(**single, eps=EPS, rounding=rounding, backend="reference")
    print(f"{str(dtype).removeprefix('torch.')}, rounding={rounding!r}, {VTP_TOKENS} tokens, q {Q_WIDTH} / k {K_WIDTH} wide:")
    for tp in (1, 2, 4, 8):
        x = full_inputs(dtype)
        contract.virtual_tp(x["q"], x["k"], x["q_weight"], x["k_weight"], tp, EPS, rounding=rounding)
        line = []
        for n in ("q", "k"):
            vs_single = agreement(n, x[n], single[n].double(), None, "fused", tol)
            same = (x[n] == single[n]).double().mean().item()
            vs_contract = agreement(n, x[n], *want[n], rounding, tol)
            line.append(f"{n}: {vs_single.max_ulp:.3g} ulp from cross_head_norm ({same:.1%} identical), "
                        f"contract {'ok' if vs_contract.ok else 'FAIL'} ({vs_contract.max_ulp:.3g} ulp)")
        print(f"  tp={tp}: " + "; ".join(line))

# %% [markdown]
# At tp=1 virtual TP *is* `cross_head_norm` (the same sums in the same order). From tp=2 on the
# float32 sum is accumulated in another order and differs in its last bits: visible as a few
# ulps in a float32 output, and in bf16 almost always absorbed by the final rounding (an element
# can land one bf16 ulp away when its value sits near a rounding boundary). Every tp stays inside
# the contract's tolerance.
#
# ## 5. The eps pitfall
#
# The statistic is `mean(x^2) + eps` over the **full** row. An implementation assembled from
# per-shard pieces can silently put eps somewhere else. Two natural mistakes, both written below
# as **deliberately WRONG** negative controls (never use them):
#
# * **eps added to the total sum of squares** instead of to the mean (e.g. `rsqrt(sum + eps) *
#   sqrt(width)`, a common way to save a division): `rsqrt((sum + eps) / width)` is
#   `rsqrt(mean + eps / width)`, so the effective eps is `eps / width`;
# * **eps added to each shard's partial sum** before the all-reduce (reusing a local kernel's
#   `sum + eps`): the total carries `tp * eps`, effective eps `tp * eps / width`.
#
# Both agree with the right answer on ordinary rows, where `mean(x^2)` dwarfs eps, and are far
# off on **small-magnitude rows**, whose `mean(x^2)` is comparable to eps: there eps is what keeps
# the output small, and a 6144-times-smaller eps lets it blow up. The rows below are scaled to a
# root mean square of 1 down to 1e-4 (float32, so that only the eps placement differs):

# %%
def WRONG_eps_in_the_sum(x, w, tp, eps, per_shard):
    """WRONG, on purpose (a negative control): eps folded into the sum of squares, either once into
    the total (effective eps = eps / width) or into each shard's partial (= tp * eps / width)."""
    shards = x.float().tensor_split(tp, dim=-1)
    partials = [s.square().sum(-1, keepdim=True) + (eps if per_shard else 0.0) for s in shards]
    total = torch.stack(partials).sum(0) + (0.0 if per_shard else eps)
    rstd = torch.rsqrt(total / x.shape[-1])
    return (x.float() * rstd * w.float()).to(x.dtype)


RMS = [1.0, 1e-2, 1e-3, 3e-4, 1e-4]
PITFALL_TP = 8
rows = contract.make_full_inputs(len(RMS), Q_WIDTH, K_WIDTH, torch.float32, DEVICE, seed=11)
scale = torch.tensor(RMS, dtype=torch.float32, device=DEVICE)[:, None]
rows["q"].mul_(scale)  # q and k are views into one qkv tensor: scale their rows in place
rows["k"].mul_(scale)
exact_q = cross.expected(rows, EPS, 0.0, "fused")["q"][0]

ours = {n: t.clone() for n, t in rows.items()}
contract.virtual_tp(ours["q"], ours["k"], ours["q_weight"], ours["k_weight"], PITFALL_TP, EPS)
candidates = {
    "ours (virtual_tp)": ours["q"],
    "WRONG eps in the total": WRONG_eps_in_the_sum(rows["q"], rows["q_weight"], PITFALL_TP, EPS, per_shard=False),
    "WRONG eps per shard": WRONG_eps_in_the_sum(rows["q"], rows["q_weight"], PITFALL_TP, EPS, per_shard=True),
}
effective = {"ours (virtual_tp)": EPS, "WRONG eps in the total": EPS / Q_WIDTH,
             "WRONG eps per shard": PITFALL_TP * EPS / Q_WIDTH}

print(f"q rows of width {Q_WIDTH} at tp={PITFALL_TP}, eps={EPS:g}: largest relative error of a row "
      f"(max |y - exact| / max |exact|)\n")
print(f"{'':24} {'effective eps':>13} | " + " | ".join(f"rms {r:<7g}" for r in RMS))
for name, y in candidates.items():
    rel = ((y.double() - exact_q).abs().amax(-1) / exact_q.abs().amax(-1)).tolist()
    print(f"{name:24} {effective[name]:13.3g} | " + " | ".join(f"{e:11.2e}" for e in rel))

print("\nThe contract's check on the same rows:")
for name, y in candidates.items():
    verdict = agreement("q", y, exact_q, None, "fused", contract.TOLERANCES[torch.float32])
    print(f"  {name}: {verdict.message[:230]}{'...' if len(verdict.message) > 230 else ''}")

# %% [markdown]
# At a row rms of 1e-3, `mean(x^2)` equals eps: the right rstd is `1 / sqrt(2e-6)`, both wrong
# ones are close to `1 / sqrt(1e-6)`, a 41 % error; at 1e-4 the wrong outputs are about ten times
# too large. (Averaging each shard and then averaging the shard means is *not* a mistake: with
# equal shards the mean of the means is the mean; the error is only ever where eps is added.)
#
# The other end: **eps = 0**. An all-zero row then has `mean(x^2) + eps == 0`, and a plain
# `rsqrt` gives `inf`, times 0: NaN. The contract says `rstd = 0` there, so the row stays zero:

# %%
zeros = contract.make_full_inputs(4, 256, 64, torch.float32, DEVICE, seed=5)
zeros["q"][1].zero_()
zeros["k"][1].zero_()
naive = zeros["q"] * torch.rsqrt(zeros["q"].square().mean(-1, keepdim=True) + 0.0) * zeros["q_weight"]
print(f"naive x * rsqrt(mean(x^2) + 0) on the zero row: {naive[1, :4].tolist()} ...")
want = cross.expected(zeros, 0.0, 0.0, "fused")
contract.virtual_tp(zeros["q"], zeros["k"], zeros["q_weight"], zeros["k_weight"], 4, 0.0)
for n in ("q", "k"):
    print(f"ours, eps=0, tp=4, {n}: zero row all zeros: {bool((zeros[n][1] == 0).all())}; "
          f"any NaN: {bool(zeros[n].isnan().any())}; "
          f"{agreement(n, zeros[n], want[n][0], None, 'fused', contract.TOLERANCES[torch.float32]).message}")

# %% [markdown]
# ## 6. The implementations
#
# The registry is the list; each lead says what changed and which bottleneck it removes. The
# reference and the Numba pipelines (v1, and v2 on bf16 rows read as 32-bit words) take any
# `torch.distributed` group (gloo on CPUs, NCCL on GPUs); `cuda_v1` is the same three steps as
# CUDA C kernels around an NCCL all-reduce; `cuda_v2` is one kernel per call that exchanges the
# sums itself. `all_gather` is the naive baseline.

# %%
for impl in registry.implementations(OP):
    print(f"{impl.name:<11} ({impl.level}, v{impl.version}): {impl.lead}")
print(f"\nbackend='cuda' runs {registry.latest(OP, 'cuda').name} when every GPU of the group can write into every "
      f"other's memory (one node, P2P), else cuda_v1, and says so once.")

# %% [markdown]
# The fused kernel lives in the torch-free header `kernels_cuda/tp_qk_norm.cuh`. Its section
# opens with the lead and the mapping, which names its four phases:

# %%
walkthrough.excerpt("kernels_cuda/tp_qk_norm.cuh", "// v2: one fused kernel", "constexpr int kFusedThreads", occurrence=-1)

# %% [markdown]
# The kernel itself, `fused_kernel`, up to its fourth phase (the rest of the header carries the
# later versions' kernels and the launchers):

# %%
walkthrough.show_kernel(OP, "cuda_v2", "fused_kernel")

# %% [markdown]
# ## 7. The fused kernel's protocol
#
# `cuda_v2` replaces "kernel, NCCL all-reduce, kernel" by one kernel that **stores** its partial
# sums straight into its peers' memory and waits for theirs. Each rank owns one buffer of 64-bit
# words, allocated with PyTorch's symmetric memory, which maps every peer's buffer into every
# rank's address space (`cookbook/tp_workspace.py`). The design questions, and their answers:
#
# * **How does a reader know a word is this call's, not a stale one?** Every word is
#   `(epoch << 32) | payload`, where the epoch is the call number. A reader spins until the tag
#   equals the current epoch. A 64-bit store is single-copy atomic, so a matching tag vouches
#   for its payload.
# * **Why no sentinel?** A "not yet written" value (0, NaN, ...) would have to be one that real
#   data can never take (an all-zero row's sum of squares *is* 0.0, whose bits are 0) and would
#   have to be reset after every read: an extra kernel or barrier per call. A tag never collides
#   with data and never needs a reset: the next call simply looks for a different tag. A fresh
#   buffer is zeroed, tag 0, and epochs skip 0.
# * **Why two parities?** The buffer has two halves, used by even and odd epochs. A rank can be at
#   most one call ahead of a peer: it cannot finish call n + 1 without the peer's sums of call
#   n + 1, which the peer sends only after finishing call n. So call n + 2, the next writer of
#   call n's half, starts only after every rank has read call n. With a single half, a fast rank's
#   next call would overwrite words a slow peer has not read yet.
# * **Why the header check prevents hangs.** If ranks disagree on the token count, a rank with
#   more tokens would wait forever for sums the others never send. So every call first publishes
#   a header (the call's T and both shard widths) to every rank, and every CTA compares all
#   ranks' headers **before** waiting for any sum. Ranks that disagree skip the wait, leave their
#   shards untouched, and record the mismatch in a pinned host word; the next call on each rank
#   raises it as a `ValueError`. The header is published even with no tokens.
# * **Why a failed call's later chunks do nothing.** A call longer than the workspace's capacity
#   runs as several launches (chunks), one epoch each, every one carrying the whole call's T in
#   its header. If the ranks disagree on T they may also disagree on the number of chunks: the
#   rank with more chunks would wait in its second chunk for a header the other rank sends only
#   with its next call. So the first chunk, on a mismatch, notes the epoch the call's later chunks
#   will run at, and those chunks do nothing and leave the epoch alone.
# * **Why the epoch wraps to 2.** Epochs are 32-bit tags that skip 0 (a fresh buffer's tag);
#   after `2^32 - 1` (odd) comes 2 (even), so the parities keep alternating across the wrap. The
#   real kernel also zeroes, in the last two launches before the wrap, the half of its buffer each
#   used, so no word from the previous cycle can look current after it.
# * **Why CUDA graphs work.** The epoch is not a kernel argument (a graph replays its arguments
#   frozen at capture): it lives in device memory, every CTA reads it at the start, and once
#   every CTA has read it the last one advances it (v2 and v3 at the end of the kernel, v4 and v5
#   as soon as the last CTA has counted itself in). A replay therefore runs the next epoch, like an
#   eager call. v5's programmatic launch may start before the previous kernel ends, but its CTAs
#   read nothing, the epoch included, before `griddepcontrol.wait` says that kernel has finished.
#
# The simulation below models exactly that on lists of Python ints: each rank's buffer with the
# layout of `tp_workspace` (headers, then slots indexed by parity, token, tensor, source), its
# epoch counter, and one launch as a generator that *yields* after every store and every poll of
# a word that is not tagged yet. A scheduler interleaves the ranks' steps (at random, or
# adversarially: one rank runs as far as it can before the other moves). One simulated CTA per
# rank does all the tokens; calls longer than the workspace's capacity run as several launches
# (chunks), each one epoch, as the real launcher does, with the same rule for a failed call's
# later chunks. The rows hold small integers, so the float32 sums are exact and the check is
# equality.

# %%
HEADER_WORDS, NUM_TENSORS, MASK32 = tp_workspace.HEADER_WORDS, tp_workspace.NUM_TENSORS, 0xFFFFFFFF


def f32_bits(x):
    return struct.unpack("<I", struct.pack("<f", x))[0]


def from_bits(u):
    return struct.unpack("<f", struct.pack("<I", u))[0]


def tagged(epoch, payload):
    return (epoch << 32) | payload


EPOCH_AFTER_WRAP = 2  # even, like the epoch after any odd one


def next_epoch(epoch):  # 1, 2, ..., 2^32 - 1, 2, 3, ...: 0 is a fresh buffer's tag
    return EPOCH_AFTER_WRAP if epoch == MASK32 else epoch + 1


class SimRank:
    """One rank's buffer (its peers write into it) and its device-side epoch counter."""

    def __init__(self, world, capacity, parities=tp_workspace.PARITIES):
        self.world, self.capacity, self.parities = world, capacity, parities
        self.buffer = [0] * (parities * world * HEADER_WORDS + parities * capacity * NUM_TENSORS * world)
        self.epoch = tp_workspace.FIRST_EPOCH
        self.failed_epoch = 0  # the epoch a failed call's later chunks run at (a device counter)
        self.status = []  # the mismatches a launch recorded (the pinned host word of the real workspace)

    def header(self, parity, source, word):
        return (parity * self.world + source) * HEADER_WORDS + word

    def slot(self, parity, token, tensor, source):
        base = self.parities * self.world * HEADER_WORDS
        return base + ((parity * self.capacity + token) * NUM_TENSORS + tensor) * self.world + source


assert len(SimRank(4, 32768).buffer) == tp_workspace.buffer_words(4, 32768)  # the real layout's size


def launch(ranks, me, chunk, chunk_index, call_tokens, widths, out, abandon=True):
    """One launch of the fused kernel on rank `me`: header, push, check, wait, write, advance."""
    r = ranks[me]
    epoch = r.epoch  # read from device memory, not passed in: CUDA-graph replays see the next one
    if abandon and chunk_index > 0 and r.failed_epoch == epoch:
        return  # a later chunk of a call whose first chunk found a mismatch: nothing to do
    parity = epoch % r.parities
    # the real header's words (tokens, widths, eps, weight_offset, the math word), for this call
    mine = tp_workspace.header(call_tokens, *widths, 1e-6, 0.0, torch.bfloat16, "fused", torch.bfloat16,
                               torch.bfloat16, version=12)
    for dest in ranks:  # the header goes to every rank, itself included
        for word, value in enumerate(mine):
            dest.buffer[dest.header(parity, me, word)] = tagged(epoch, value)
    yield "store"
    for t, rows in enumerate(chunk):  # push every partial before waiting on anything
        for tensor, row in enumerate(rows):
            partial = f32_bits(sum(v * v for v in row))
            for dest in ranks:
                dest.buffer[dest.slot(parity, t, tensor, me)] = tagged(epoch, partial)
                yield "store"
    agree = True
    for source in range(r.world):  # every rank's header before any sum
        for word in range(HEADER_WORDS):
            while (w := r.buffer[r.header(parity, source, word)]) >> 32 != epoch:
                yield "wait"
            if w & MASK32 != mine[word]:
                agree = False
                if chunk_index == 0:
                    r.failed_epoch = next_epoch(epoch)  # the epoch the later chunks will see
                r.status.append(f"{tp_workspace.HEADER_FIELDS[word]}: rank {source} has {w & MASK32}, "
                                f"this rank {mine[word]}")
    if agree:  # a mismatch leaves the shards untouched
        for t in range(len(chunk)):
            totals = []
            for tensor in range(NUM_TENSORS):
                total = 0.0
                for source in range(r.world):  # rank order: every rank adds the same floats alike
                    while (w := r.buffer[r.slot(parity, t, tensor, source)]) >> 32 != epoch:
                        yield "wait"
                    total += from_bits(w & MASK32)
                totals.append(total)
            out.append(tuple(totals))
    r.epoch = next_epoch(epoch)  # the last CTA's job in the real kernel
    yield "store"


def program(ranks, me, calls, results, abandon=True):
    """Rank `me` makes its calls in order; a call above the capacity runs as several chunks."""
    for rows, widths in calls:
        out, first = [], 0
        while True:
            chunk = rows[first:first + ranks[me].capacity]
            yield from launch(ranks, me, chunk, first // ranks[me].capacity, len(rows), widths, out, abandon)
            first += ranks[me].capacity
            if first >= len(rows):
                break
        results.append(out)


def run(programs, schedule, rng, patience=5000):
    """Interleave the ranks' steps; "deadlock" when every live rank only polls for `patience` steps."""
    live, idle, current = dict(enumerate(programs)), 0, 0
    while live:
        me = rng.choice(list(live)) if schedule == "random" else (current if current in live else min(live))
        try:
            step = next(live[me])
        except StopIteration:
            del live[me]
            continue
        idle = idle + 1 if step == "wait" else 0
        if step == "wait" and schedule == "greedy":  # the adversary: switch only when blocked
            order = sorted(live)
            current = order[(order.index(me) + 1) % len(order)]
        if idle > patience:
            return "deadlock"
    return "ok"


def random_calls(world, tokens_per_call, rng, q_shard=4, k_shard=2, zero_rows=True):
    """Full rows of small integers (exact float32 sums), some all zero; returned per rank as shards."""
    full = []
    for tokens in tokens_per_call:
        call = []
        for _ in range(tokens):
            q = [rng.randint(-3, 3) for _ in range(q_shard * world)]
            k = [rng.randint(-3, 3) for _ in range(k_shard * world)]
            if zero_rows and rng.random() < 0.2:
                q, k = [0] * len(q), [0] * len(k)
            call.append((q, k))
        full.append(call)
    shards = [[([(q[r * q_shard:(r + 1) * q_shard], k[r * k_shard:(r + 1) * k_shard]) for q, k in call],
                (q_shard, k_shard)) for call in full] for r in range(world)]
    want = [[(float(sum(v * v for v in q)), float(sum(v * v for v in k))) for q, k in call] for call in full]
    return shards, want


def simulate(world, tokens_per_call, schedule, seed, capacity=4, parities=tp_workspace.PARITIES):
    rng = random.Random(seed)
    shards, want = random_calls(world, tokens_per_call, rng)
    ranks = [SimRank(world, capacity, parities) for _ in range(world)]
    results = [[] for _ in range(world)]
    verdict = run([program(ranks, r, shards[r], results[r]) for r in range(world)], schedule, rng)
    if verdict == "ok" and any(res != want for res in results):
        verdict = "WRONG"
    return verdict, ranks


# %% [markdown]
# Many sequences of calls with varying token counts (0 to 9 tokens, with a capacity of 4 tokens
# so that longer calls run as 2 or 3 chunks; about one row in five all zero), over random
# interleavings of 2 and 4 ranks and the adversarial schedule: every rank must end with the exact
# full-row sums of every call, and with one epoch per launch.

# %%
for world in (2, 4):
    for schedule in ("random", "greedy"):
        verdicts, epochs = {}, set()
        for seed in range(25):
            tokens = [random.Random(seed).randint(0, 9) for _ in range(6)]
            verdict, ranks = simulate(world, tokens, schedule, seed)
            verdicts[verdict] = verdicts.get(verdict, 0) + 1
            epochs.add(tuple(r.epoch for r in ranks))
        print(f"{world} ranks, {schedule:>6} schedule, 2 parities: {verdicts} "
              f"(epochs at the end equal on every rank: {all(len(set(e)) == 1 for e in epochs)})")

# %% [markdown]
# Why two parities: the same sequences with a single buffer half. The tags still prevent wrong
# data (a reader never accepts a word of another epoch), but a rank that runs one call ahead
# overwrites words its slower peer has not read yet, and the peer then waits for a tag that will
# never come again:

# %%
for schedule in ("random", "greedy"):
    verdicts = {}
    for seed in range(25):
        tokens = [random.Random(seed).randint(1, 9) for _ in range(6)]
        verdict, _ = simulate(2, tokens, schedule, seed, parities=1)
        verdicts[verdict] = verdicts.get(verdict, 0) + 1
    print(f"2 ranks, {schedule:>6} schedule, 1 parity: {verdicts}")

# %% [markdown]
# And a mismatch: rank 0 calls with 3 tokens while rank 1 calls with 2 (a bug in the caller).
# Without the header check rank 0 would wait forever for rank 1's third token. With it, both
# ranks finish the call without writing anything, each records what it saw (the real kernel
# writes it to the pinned `status` word; `raise_pending_errors` raises it at the next call), and
# the next, matching, call is correct: the epochs stayed in step.

# %%
rng = random.Random(0)
shards, want = random_calls(2, [3, 2], rng)  # the intended calls: 3 tokens, then 2
short, _ = random_calls(2, [2], rng)  # rank 1's buggy first call: 2 tokens
calls = [shards[0], [short[1][0], shards[1][1]]]
ranks = [SimRank(2, capacity=4) for _ in range(2)]
results = [[], []]
verdict = run([program(ranks, me, calls[me], results[me]) for me in range(2)], "random", rng)
print(f"run: {verdict}; epochs {[r.epoch for r in ranks]}")
for me, r in enumerate(ranks):
    print(f"rank {me}: call 1 wrote {len(results[me][0])} tokens, recorded {r.status}; "
          f"call 2 correct: {results[me][1] == want[1]}")

# %% [markdown]
# A mismatch across the chunk boundary: rank 0 calls with 5 tokens (two chunks at a capacity of
# 4), rank 1 with 3 (one chunk), then both make a matching call. Without the rule for a failed
# call's later chunks, rank 0's second chunk waits for a header rank 1 sends only with its next
# call, and the two ranks fall out of step; with it, both finish, record the mismatch, and the
# next call is correct:

# %%
for abandon in (False, True):
    rng = random.Random(1)
    shards, want = random_calls(2, [5, 2], rng)  # the intended calls: 5 tokens, then 2
    short, _ = random_calls(2, [3], rng)  # rank 1's buggy first call: 3 tokens
    calls = [shards[0], [short[1][0], shards[1][1]]]
    ranks = [SimRank(2, capacity=4) for _ in range(2)]
    results = [[], []]
    verdict = run([program(ranks, me, calls[me], results[me], abandon) for me in range(2)], "random", rng)
    correct = [len(res) > 1 and res[1] == want[1] for res in results]
    print(f"later chunks of a failed call {'do nothing' if abandon else 'run as usual'}: {verdict}; "
          f"epochs {[r.epoch for r in ranks]}; the matching call after it correct on each rank: {correct}")

# %% [markdown]
# And the wrap: the same random sequences with the epoch counters started 3 launches before
# `2^32 - 1`, so the calls cross it (the parities alternate through it: `..., 2^32 - 1, 2, 3`):

# %%
verdicts = {}
for seed in range(25):
    rng = random.Random(seed)
    shards, want = random_calls(2, [random.Random(seed).randint(0, 9) for _ in range(6)], rng)
    ranks = [SimRank(2, capacity=4) for _ in range(2)]
    for r in ranks:
        r.epoch = MASK32 - 3
    results = [[], []]
    verdict = run([program(ranks, me, shards[me], results[me]) for me in range(2)], "random", rng)
    verdict = "WRONG" if verdict == "ok" and any(res != want for res in results) else verdict
    verdicts[verdict] = verdicts.get(verdict, 0) + 1
print(f"2 ranks across the epoch wrap: {verdicts}; epochs at the end {[r.epoch for r in ranks]}")

# %% [markdown]
# What the simulation leaves out: the real kernel runs many CTAs per rank, each owning a tile of
# tokens, and the argument that they cannot deadlock is that **every CTA pushes all its partial
# sums before it waits**, and CTAs are dispatched in index order (tokens in order). On every rank
# the resident CTAs have therefore already pushed; take the rank whose first not-yet-dispatched
# token is smallest: all peers have pushed every token before it, so its resident CTAs complete
# and free room for the next ones. The last CTA of a launch to have read the epoch advances it (a
# counter of CTAs), and stream order publishes it to the next launch.
#
# The workspace per rank: two parities of `capacity x 2 tensors x world` words of 8 bytes, plus
# the headers; calls above the capacity run as several launches:

# %%
for world in (2, 4, 8):
    words = tp_workspace.buffer_words(world)
    print(f"tp={world}: {words} words = {human(words * 8)} per rank "
          f"(capacity {tp_workspace.CAPACITY_TOKENS} tokens per launch)")

# %% [markdown]
# ## 8. Real TP numbers
#
# The 2-GPU benchmark (`python -m cookbook bench --ops tp_qk_norm`, which starts itself under
# torchrun, one process per GPU) times every implementation side by side with the communication
# alone (the NCCL all-reduce of the `[T, 2]` sums and PyTorch's symmetric-memory one-shot
# all-reduce) and the same shard's single-GPU `cross_head_norm`, and with `--results-dir
# docs/results` writes `docs/results/tp_qk_norm_<gpu>x<tp>.md`. The recorded pages, if any (each
# names its GPUs, date, commit and command):

# %%
pages = walkthrough.results_pages(OP) + walkthrough.results_pages(OP, "decode")
if not pages:
    print("No recorded results yet (docs/results/tp_qk_norm_h200x2.md is written by "
          "`python -m cookbook bench --ops tp_qk_norm --results-dir docs/results` on a node with 2 GPUs).")
for page in pages:
    walkthrough.results_link(page)

# %% [markdown]
# ## Where to go next
#
# * [`docs/tp_qk_norm.md`](../docs/tp_qk_norm.md): the op page (contract, the protocol, scaling to
#   4 and 8 GPUs and across nodes, limits, results).
# * `cookbook/tp_workspace.py`: the workspace, its layout and the protocol's docstring.
# * `python -m cookbook bench --ops tp_qk_norm` on a node with 2 GPUs: the side-by-side timing.
