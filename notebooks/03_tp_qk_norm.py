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
# # `tp_qk_norm`: a cross-head norm split over tensor-parallel GPUs
#
# Notebook 02's `cross_head_norm` under **tensor parallelism**: each GPU holds a column *shard*
# of q and k, yet the statistic is over the full row. The lesson is **communication**: two floats
# per token cross the GPUs, eps stays on the full row's mean, and one kernel exchanges the floats
# through the peers' memory and never hangs. The order: the identity, the bytes, the algorithm on
# one device, the eps pitfall, the op on a process group, the protocol simulated, then the
# **ladder** of eight CUDA C rungs and the tuned kernel's policy. It all runs in one process on a
# laptop (the benchmark runs a process per GPU); the code shown is read from the tested sources.

# %%
import sys
from pathlib import Path

# Run from a checkout (e.g. `notebooks/`): make its packages importable, whether installed or not.
ROOT = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "cookbook" / "walkthrough.py").is_file()), None)
if ROOT is not None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cookbook import walkthrough  # imports neither Numba nor a CUDA extension

session = walkthrough.setup("tp_qk_norm")  # without a GPU: NUMBA_ENABLE_CUDASIM=1, before anything imports Numba
DEVICE = session.device

# %%
import random
import struct

import torch
import torch.distributed as dist

import cookbook
from cookbook import registry, tp_workspace
from cookbook.ops import cross_head_norm as cross
from cookbook.testing import agreement

OP = "tp_qk_norm"
contract = registry.contract(OP)  # the contract module cookbook/ops/tp_qk_norm.py
EPS = 1e-6
Q_WIDTH, K_WIDTH = 6144, 1024  # MiniMax-M2: q and k normalized over their full widths

# %% [markdown]
# ## 1. The identity that makes it cheap
#
# With `tp` ranks, rank `r` holds `[T, 6144 / tp]` of q, `[T, 1024 / tp]` of k and the matching
# weight slices; no rank holds a row. Engines first all-gathered the shards: the whole activation
# crosses the GPUs. But the statistic is a sum, and a sum splits over the shards:
#
# ```
# sum(x^2) = sum over ranks r of sum(x_r^2)
# rstd     = rsqrt(sum(x^2) / full_width + eps)      (0 where that is 0)
# y_r      = x_r * rstd * (w_r + weight_offset)
# ```
#
# so each rank sums its shard's squares (two floats per token: q's and k's), the ranks
# all-reduce those `[T, 2]` floats, and each normalizes its own columns with the full width.
#
# ## 2. What crosses the GPUs
#
# Per rank and call, bf16. The all-gather receives `(tp - 1) / tp` of the `(6144 + 1024)`-wide
# rows; the fused kernel receives two 8-byte *tagged words* per token from each peer (a float
# and a 32-bit tag, section 6):

# %%
def mib(n):
    return f"{n / 2**20:.3g} MiB"


print(f"{'tp':>3} {'tokens':>6} | {'all-gather':>10} | {'tagged words':>12} | ratio")
for tp in (2, 4, 8):
    for tokens in (1, 16384):
        gathered = (tp - 1) * tokens * (Q_WIDTH + K_WIDTH) // tp * 2
        words = (tp - 1) * tokens * contract.NUM_TENSORS * 8
        print(f"{tp:>3} {tokens:>6} | {mib(gathered):>10} | {mib(words):>12} | {gathered / words:.0f}x")

# %% [markdown]
# The ratio does not depend on T. At one token the words are a few bytes and their cost is
# **latency**: a collective launch costs several times the op (the page's napkin math), so the
# exchange has to live inside the kernel.
#
# ## 3. The algorithm on one device
#
# The reference is three steps around one collective, from the tested source:

# %%
walkthrough.excerpt("cookbook/ops/tp_qk_norm.py", "def reference(", "def all_gather_norm(")

# %% [markdown]
# `virtual_tp` runs the same algorithm on full tensors in one process: the columns cut into
# `tp` shards, each shard's sums on its own, the all-reduce a sum over shards. Only the order of
# the float32 partial sums differs from `cross_head_norm`. At MiniMax-M2's widths, against
# `cross_head_norm`'s reference and the contract (the float64 value):

# %%
TOKENS = 16
for dtype in (torch.bfloat16, torch.float32):
    single = contract.make_full_inputs(TOKENS, Q_WIDTH, K_WIDTH, dtype, DEVICE, seed=7)
    want = cross.expected(single, EPS, 0.0, "fused")
    cookbook.cross_head_norm(**single, eps=EPS, backend="reference")
    line = []
    for tp in (1, 2, 4, 8):
        x = contract.make_full_inputs(TOKENS, Q_WIDTH, K_WIDTH, dtype, DEVICE, seed=7)
        contract.virtual_tp(x["q"], x["k"], x["q_weight"], x["k_weight"], tp, EPS)
        same = (x["q"] == single["q"]).double().mean().item()
        ok = all(agreement(n, x[n], *want[n], "fused", contract.TOLERANCES[dtype]).ok for n in ("q", "k"))
        line.append(f"tp={tp}: {same:.1%} identical, contract {'ok' if ok else 'FAIL'}")
    print(f"{str(dtype).removeprefix('torch.'):>8} q: " + "; ".join(line))

# %% [markdown]
# From tp=2 on the float32 sum is accumulated in another order: a few ulps in float32, absorbed
# by bf16's rounding here. Every tp stays inside the contract.
#
# ## 4. The eps pitfall
#
# The statistic is `mean(x^2) + eps` over the **full** row. Two natural mistakes, written below as
# **deliberately WRONG** negative controls: eps added to the total sum of squares (effective eps
# `eps / width`), and eps added to each shard's partial (`tp * eps / width`). Both agree with the
# right answer on ordinary rows and are far off on rows whose `mean(x^2)` is comparable to eps:

# %%
def WRONG_eps_in_the_sum(x, w, tp, eps, per_shard):
    """WRONG, on purpose (a negative control): eps folded into the sum of squares, once into the
    total (effective eps = eps / width) or into each shard's partial (= tp * eps / width)."""
    partials = [s.square().sum(-1, keepdim=True) + (eps if per_shard else 0.0) for s in x.float().tensor_split(tp, dim=-1)]
    total = torch.stack(partials).sum(0) + (0.0 if per_shard else eps)
    return (x.float() * torch.rsqrt(total / x.shape[-1]) * w.float()).to(x.dtype)


RMS, TP = [1.0, 1e-3, 1e-4], 8
rows = contract.make_full_inputs(len(RMS), Q_WIDTH, K_WIDTH, torch.float32, DEVICE, seed=11)
scale = torch.tensor(RMS, device=DEVICE)[:, None]
rows["q"].mul_(scale)  # q and k are views into one qkv tensor: scale their rows in place
rows["k"].mul_(scale)
exact_q = cross.expected(rows, EPS, 0.0, "fused")["q"][0]
ours = {n: t.clone() for n, t in rows.items()}
contract.virtual_tp(ours["q"], ours["k"], ours["q_weight"], ours["k_weight"], TP, EPS)
candidates = {"ours (virtual_tp)": ours["q"],
              "WRONG eps in the total": WRONG_eps_in_the_sum(rows["q"], rows["q_weight"], TP, EPS, False),
              "WRONG eps per shard": WRONG_eps_in_the_sum(rows["q"], rows["q_weight"], TP, EPS, True)}
print(f"largest relative error per row (q width {Q_WIDTH}, tp={TP}), rms " + " | ".join(f"{r:g}" for r in RMS))
for name, y in candidates.items():
    rel = ((y.double() - exact_q).abs().amax(-1) / exact_q.abs().amax(-1)).tolist()
    verdict = agreement("q", y, exact_q, None, "fused", contract.TOLERANCES[torch.float32])
    print(f"  {name:<24} " + " | ".join(f"{e:8.1e}" for e in rel) + f"   contract: {'PASS' if verdict.ok else 'REJECT'}")

# %% [markdown]
# At rms 1e-3, `mean(x^2)` equals eps: the right rstd is `1 / sqrt(2e-6)`, the wrong ones near
# `1 / sqrt(1e-6)`, a 41 % error; at 1e-4 the wrong outputs are about ten times too large. The
# contract's check rejects both.
#
# ## 5. The op on a process group
#
# `cookbook.tp_qk_norm` is a collective: every rank of `group` makes the same call. A gloo group
# of one rank in this process shows the call (the tests run 2 and 4 gloo ranks); a bad argument
# is refused before anything is written, naming the argument:

# %%
if not dist.is_initialized():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
shard = contract.shard_of(contract.make_full_inputs(4, 256, 64, torch.bfloat16, "cpu", seed=3), 0, 1)
before = shard["q_shard"].clone()
cookbook.tp_qk_norm(**shard, eps=EPS, group=dist.group.WORLD, backend="numba")
print(f"normalized on the group: {not torch.equal(shard['q_shard'], before)}")
try:
    cookbook.tp_qk_norm(shard["q_shard"], shard["k_shard"], shard["q_weight_shard"][:-2], shard["k_weight_shard"],
                        eps=EPS, group=dist.group.WORLD)
except ValueError as error:
    print(f"ValueError: {error}")

# %% [markdown]
# ## 6. The protocol, simulated
#
# The fused kernel replaces "kernel, all-reduce, kernel" by one kernel that **stores** its partial
# sums into its peers' buffers (*symmetric memory*: every rank's buffer mapped into every peer)
# and polls its own. Every word is `(epoch << 32) | payload`, the *epoch* being the call number; a
# reader waits for the current one, so nothing is ever reset. Even and odd epochs use separate
# halves (*parities*); each launch publishes its *header* (the call's shape and arguments) and
# compares every rank's before writing. (The page's "The protocol" has why each.)
#
# The simulation runs that on Python ints: each rank's buffer in `tp_workspace`'s layout, a launch
# as a generator that yields after every store and every poll of an untagged word, and a scheduler
# that interleaves the ranks at random or adversarially (a rank runs until it blocks). Rows of
# small integers make the float32 sums exact.

# %%
HEADER_WORDS, MASK32 = tp_workspace.HEADER_WORDS, 0xFFFFFFFF
f32_bits = lambda x: struct.unpack("<I", struct.pack("<f", x))[0]  # noqa: E731
from_bits = lambda u: struct.unpack("<f", struct.pack("<I", u))[0]  # noqa: E731
next_epoch = lambda e: 2 if e == MASK32 else e + 1  # noqa: E731  (1, 2, ..., 2^32 - 1, 2, 3, ...)


class SimRank:
    """One rank's buffer (its peers write into it) and its device-side epoch counter."""

    def __init__(self, world, capacity=16, parities=tp_workspace.PARITIES, epoch=tp_workspace.FIRST_EPOCH):
        self.world, self.capacity, self.parities, self.epoch = world, capacity, parities, epoch
        self.buffer = [0] * tp_workspace.buffer_words(world, capacity)
        self.status = []  # mismatches a launch recorded (the real workspace's pinned host word)

    def header(self, parity, source, word):
        return (parity * self.world + source) * HEADER_WORDS + word

    def slot(self, parity, token, tensor, source):
        base = tp_workspace.PARITIES * self.world * HEADER_WORDS
        return base + ((parity * self.capacity + token) * contract.NUM_TENSORS + tensor) * self.world + source


def launch(ranks, me, rows, out):
    """One launch on rank `me`: publish the header, push every partial, check headers, wait, sum."""
    r = ranks[me]
    epoch, parity = r.epoch, r.epoch % r.parities  # read from device memory: a graph replay sees the next
    mine = tp_workspace.header(len(rows), 4, 2, EPS, 0.0, torch.bfloat16, "fused", torch.bfloat16, torch.bfloat16, 0)
    for dest in ranks:
        for word, value in enumerate(mine):
            dest.buffer[dest.header(parity, me, word)] = (epoch << 32) | value
    for t, row in enumerate(rows):  # push every partial before waiting on anything
        for tensor, x in enumerate(row):
            for dest in ranks:
                dest.buffer[dest.slot(parity, t, tensor, me)] = (epoch << 32) | f32_bits(sum(v * v for v in x))
                yield "store"
    agree = True
    for source in range(r.world):
        for word in range(HEADER_WORDS):
            while (w := r.buffer[r.header(parity, source, word)]) >> 32 != epoch:
                yield "wait"
            if w & MASK32 != mine[word]:
                agree = False
                r.status.append(f"{tp_workspace.HEADER_FIELDS[word]}: rank {source} {w & MASK32}, here {mine[word]}")
    for t in range(len(rows) if agree else 0):  # a mismatch writes nothing
        totals = []
        for tensor in range(contract.NUM_TENSORS):
            total = 0.0
            for source in range(r.world):  # rank order: every rank adds the same floats alike
                while (w := r.buffer[r.slot(parity, t, tensor, source)]) >> 32 != epoch:
                    yield "wait"
                total += from_bits(w & MASK32)
            totals.append(total)
        out.append(tuple(totals))
    r.epoch = next_epoch(epoch)  # the last CTA's job in the real kernel


def run(ranks, calls, schedule, rng, patience=5000):
    """Each rank makes its calls in order; 'deadlock' when every live rank only polls for a while."""
    results = [[] for _ in ranks]

    def program(me):
        for rows in calls[me]:
            results[me].append([])
            yield from launch(ranks, me, rows, results[me][-1])

    live, idle, current = {me: program(me) for me in range(len(ranks))}, 0, 0
    while live:
        me = rng.choice(list(live)) if schedule == "random" else (current if current in live else min(live))
        try:
            step = next(live[me])
        except StopIteration:
            del live[me]
            continue
        idle = idle + 1 if step == "wait" else 0
        if step == "wait" and schedule == "greedy":  # the adversary switches only when blocked
            current = sorted(live)[(sorted(live).index(me) + 1) % len(live)]
        if idle > patience:
            return "deadlock", results
    return "ok", results


def random_calls(world, rng, tokens):
    """Per rank, its shards of random full rows (integers in [-3, 3], some all zero) for calls of
    `tokens` tokens each, and the full rows' sums."""
    full = [[([rng.randint(-3, 3) * (rng.random() > 0.2) for _ in range(4 * world)],
              [rng.randint(-3, 3) for _ in range(2 * world)]) for _ in range(n)] for n in tokens]
    shards = [[[(q[r * 4:r * 4 + 4], k[r * 2:r * 2 + 2]) for q, k in call] for call in full] for r in range(world)]
    return shards, [[(float(sum(v * v for v in q)), float(sum(v * v for v in k))) for q, k in call] for call in full]


def trial(world, schedule, seed, **rank_args):
    rng = random.Random(seed)
    shards, want = random_calls(world, rng, [rng.randint(0, 9) for _ in range(6)])
    verdict, results = run([SimRank(world, **rank_args) for _ in range(world)], shards, schedule, rng)
    return "WRONG" if verdict == "ok" and any(res != want for res in results) else verdict


# %% [markdown]
# Many sequences of calls (0 to 9 tokens each), 2 and 4 ranks, random and adversarial schedules:
# every rank must end with the exact full-row sums of every call. Then the same with **one**
# parity, and the same across the epoch wrap:

# %%
def tally(**kwargs):
    found = {}
    for seed in range(20):
        verdict = trial(**kwargs, seed=seed)
        found[verdict] = found.get(verdict, 0) + 1
    return found


for world in (2, 4):
    for schedule in ("random", "greedy"):
        print(f"{world} ranks, {schedule:>6}, 2 parities: {tally(world=world, schedule=schedule)}")
print(f"2 ranks, greedy, 1 parity: {tally(world=2, schedule='greedy', parities=1)}")
print(f"2 ranks, random, across the wrap: {tally(world=2, schedule='random', epoch=MASK32 - 3)}")

# %% [markdown]
# With one parity the tags still prevent wrong data, but a rank one call ahead overwrites words
# its peer has not read, and the peer waits for a tag that never comes again. Now a mismatch:
# rank 0 calls with 3 tokens, rank 1 with 2 (a caller's bug). Without the header check rank 0
# would wait forever for a third token; with it both finish without writing, record what they saw
# (the real kernel's report, raised by the next call), and the next, matching call is correct:

# %%
rng = random.Random(0)
shards, want = random_calls(2, rng, [3, 2])  # the intended calls: 3 tokens, then 2
short, _ = random_calls(2, rng, [2])  # rank 1's buggy first call: 2 tokens
ranks = [SimRank(2) for _ in range(2)]
verdict, results = run(ranks, [shards[0], [short[1][0], shards[1][1]]], "random", rng)
for me, r in enumerate(ranks):
    print(f"rank {me}: call 1 wrote {len(results[me][0])} tokens, recorded {r.status}; next call correct: "
          f"{results[me][1] == want[1]}; epoch {r.epoch}")

# %% [markdown]
# ## 7. The ladder: eight CUDA C rungs
#
# The kernels live in `kernels_cuda/tp_qk_norm/`, one file per rung, its first line its lead
# (the registry repeats it); each is its own small extension. They share `exchange.cuh` (the
# protocol) and `tiles.cuh` (the tile kernels of rungs 2-4). The protocol's helpers, shown once:

# %%
walkthrough.excerpt("kernels_cuda/tp_qk_norm/exchange.cuh", "__device__ __forceinline__ uint64_t tagged(",
                    "// The GPU's global timer")

# %% [markdown]
# The rungs' leads are the page's ladder table. **Rung 1** is the reference's three steps in CUDA
# C, two kernels around NCCL's all-reduce (the fallback where GPUs cannot reach each other).
# **Rung 2** is one kernel: a CTA stages a tile of tokens in shared memory, a warp per row; lane
# `s` stores the row's partial into rank `s`'s buffer, then the header threads compare, then thread
# (row, source) waits for one word, and every rank sums in rank order (the same float everywhere):

# %%
walkthrough.excerpt("kernels_cuda/tp_qk_norm/tiles.cuh", "  // Phase 1: read, stage, sum, push.", "  // Phase 4:",
                    max_lines=16)

# %% [markdown]
# **Rungs 3 and 4** change the tiles' features, so their diffs are a few lines: rung 3 shares a
# row between warps at decode, checks the header beside the wait, advances the epoch early and
# launches *programmatically*; rung 4 issues a lane's loads as one batch (the SASS showed each
# load waiting behind the previous store into the tile):

# %%
walkthrough.diff_rungs(OP, 4, code_only=True, max_lines=32)

# %% [markdown]
# **Rung 5**, the *lagged walk*: at prefill a persistent grid of resident CTAs, each finishing a
# token two steps after pushing its sums (rows read again from L2), so nothing holds a row through
# the NVLink round trip. The finish of a step:

# %%
walkthrough.excerpt("kernels_cuda/tp_qk_norm/v5_lagged_walk.cuh", "    // 2. Finish the token", "      } else if (first_finish")

# %% [markdown]
# **Rung 6** takes one token per CTA, its block sized to the row pair, the row and its weights
# held in registers through the exchange and the next token requested before the wait. **Rung 7**
# gives each 16-byte vector a thread and reads the call's counters beside the first loads.
# **Rung 8** gives a CTA's two tokens one exchange (above rung 7's resident CTAs half of them took
# two), and computes its addresses before the wait:

# %%
walkthrough.excerpt("kernels_cuda/tp_qk_norm/v8_two_tokens_per_exchange.cuh", "    block_sum<kSumsPerExchange>(sums);",
                    "    } else if (first && header_thread")

# %% [markdown]
# ## 8. The tuned kernel: which rung's kernel runs
#
# `tuned.cuh` launches what `plan` in `policy.h` (plain C++) says for each chunk; its thresholds:

# %%
walkthrough.excerpt("kernels_cuda/tp_qk_norm/policy.h", "struct Policy {", "// What the policy reads of a chunk.")

# %% [markdown]
# `cookbook.explain` runs the same policy for a call (on a GPU the launcher's own; without one,
# compiled for the host with nvcc's registers, a compile of a minute on a small CPU). For
# MiniMax-M2's shards at TP=2 and TP=4:

# %%
for tp in (2, 4):
    for tokens in (1, 1024, 16384):
        try:  # the full widths and the group's size; each rank holds width / tp
            plan = cookbook.explain(OP, shape=(tokens, Q_WIDTH, K_WIDTH), world=tp, gpu="h100").plan
        except RuntimeError as error:  # without nvcc the host policy cannot be compiled
            print(error)
            break
        print(f"TP={tp} {tokens:>5} tokens: {plan['path']:<11} grid {int(plan['grid']):>4} x {plan['block']}, "
              f"{plan['registers']} registers")

# %% [markdown]
# ## Where to go next
#
# * [`docs/tp_qk_norm.md`](../docs/tp_qk_norm.md): the op page: the protocol, collective safety,
#   each rung's measured effect, which kernel runs, results against SGLang's fused TP kernel.
# * [`docs/results/tp_qk_norm_history.md`](../docs/results/tp_qk_norm_history.md): how the former
#   versions were measured.
