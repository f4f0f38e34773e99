"""The benchmark of the collective op `tp_qk_norm`: one process per GPU, under torchrun (and its
CPU tour: ``python -m cookbook.bench.tp --tour``, gloo ranks, agreement only).

``python -m cookbook bench --ops tp_qk_norm [--nproc N]`` starts ``torchrun --nproc-per-node N
-m cookbook.bench.tp ...`` (N: 2 by default, or every visible GPU if fewer); each rank then runs
this module on its own GPU, in one NCCL group (NVLink multicast stays off: the environment's
NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1 are passed on).

For every shape of ``tp_qk_norm.BENCH_SHAPES`` (tokens, full q width, full k width), each rank
holds its shard (q and k as views into one fused qkv shard) and times, side by side:

* every registered implementation (the all-gather baseline, the eager reference: sum of squares
  -> NCCL all-reduce -> apply, the Numba pipeline, each CUDA C version), after a correctness check
  of one call against the gathered float64 reference;
* the communication alone: the NCCL all-reduce of the ``[T, 2]`` sums, and PyTorch's
  symmetric-memory one-shot all-reduce of the same tensor;
* the same shard's single-GPU `cross_head_norm` (its tuned kernel), no communication:
  the time the fused kernel should approach once communication is hidden;
* SGLang's fused TP QK norm (`cookbook.peers.sglang_tp`), where SGLang is installed: checked against
  the gathered reference like ours, then timed the same ways; where it cannot run, its row says why.

Timing (``--timing graph``, the default): a CUDA graph of K calls (cycling through rotating input
sets, as in `cookbook.bench`) is captured on every rank; each replay starts after a cross-rank
barrier and is timed with CUDA events; per call = replay / K. A row reports the slowest rank's
median (a collective is as fast as its last rank) and that rank's p20-p80. Rank 0 writes the tables.

``--timing back_to_back`` times as SGLang's benchmark of its fused TP QK norm did for its
published figures: a CUDA graph of LAYERS calls, each on its own input set (a model's layers),
captured after B2B_WARMUP_CALLS eager calls and replayed B2B_REPLAYS times back to back between
two CUDA events, with no barrier; per call = the elapsed time / (replays x LAYERS), rank 0's
(its benchmark printed rank 0's). A row also gives the slowest rank's. The two differ: here the
ranks start once, so their skew is paid once per B2B_REPLAYS x LAYERS calls instead of once per
replay, the mean replaces the median, and the input sets are LAYERS whatever the L2 size (at
decode sizes every set stays in L2 in both methods). The results page of that mode is
``<op>_<gpu>x<tp>_back_to_back.md``.

The results pages go to ``<out>/pages`` (``--out``: bench_out); the pages of record that the docs
link to with ``--results-dir docs/results``.

Exit status: 0 when every implementation agrees; 1 when one does not; 2 when this machine cannot
run what was asked (the benchmark without 2 or more CUDA GPUs: it says what it needs, and points
to ``--tour``, which runs on a CPU) or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from cookbook import bench, registry, sources
from cookbook.ops import tp_qk_norm as tp
from cookbook.testing import agreement

OP = "tp_qk_norm"
TIMED_REPLAYS = 20
WARMUP_REPLAYS = 5
TARGET_REPLAY_US = 300.0
MAX_CALLS_PER_REPLAY = 256
DEFAULT_NPROC = 2
MEMORY_BUDGET_FRACTION = 0.25
# Extra rows besides the registry's implementations.
NCCL_SUMS = "nccl_all_reduce_sums"
SYMM_MEM_SUMS = "symm_mem_one_shot_sums"
LOCAL_SHARD = "local_cross_head_norm"
SGLANG_TP = "sglang_fused_parallel_qknorm"
DECODE = "decode"  # --shapes decode: the decode rows only (a short run)
DECODE_TOKENS = 128
MINIMAX = "minimax"  # --shapes minimax: MiniMax-M2's widths at every token count
MINIMAX_WIDTHS = (6144, 1024)
GRAPH, BACK_TO_BACK = "graph", "back_to_back"  # --timing
LAYERS = 8  # back_to_back: calls per graph, each on its own input set
B2B_WARMUP_CALLS = 10
B2B_REPLAYS = 100
# SGLang's published fused TP QK norm on 4 x H200 at MiniMax-M2's widths (us per call at each token
# count), timed back to back (see the module docstring); the pages set this run's rows beside them.
PUBLISHED_TP4_H200_US = {1: 2.6, 128: 2.9, 2048: 8.0, 16384: 52.0}
PUBLISHED_BY = "SGLang's fused TP QK norm (its benchmark: back-to-back graph replays, rank 0's mean)"
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CANNOT_RUN_HERE = 2  # the exit status where this machine cannot run the benchmark that was asked for


# --------------------------------------------------------------------------------------------
# Launching under torchrun.
# --------------------------------------------------------------------------------------------
def under_torchrun() -> bool:
    return "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(nproc: int | None, argv: list[str], *, asked: bool = True) -> int:
    """Run this module under torchrun with `nproc` ranks (default: 2, or the visible GPUs if fewer).
    Where this machine cannot, say what it needs: on stderr with exit status CANNOT_RUN_HERE when
    the benchmark was `asked` for, else (a sweep of every op on one GPU) as a skip, status 0."""
    gpus = torch.cuda.device_count()
    ranks = nproc or min(DEFAULT_NPROC, gpus)
    if 2 <= ranks <= gpus:
        return _torchrun(ranks, argv, MULTICAST_OFF)
    why = why_not_here(gpus, nproc)
    if asked:
        print(why, file=sys.stderr)
        return CANNOT_RUN_HERE
    print(f"{why}\n{OP}: skipped")
    return 0


def why_not_here(gpus: int, nproc: int | None) -> str:
    """What the benchmark needs that this machine (`gpus` visible, `nproc` ranks asked) lacks."""
    visible = "no CUDA GPU is visible" if gpus == 0 else f"{gpus} CUDA GPU{'s' if gpus > 1 else ''} visible"
    asked = f", --nproc {nproc} asked for" if nproc is not None else ""
    return (f"{OP}: its benchmark needs 2 or more CUDA GPUs on this machine, one process (rank) per GPU, which it "
            f"starts under torchrun (--nproc N: N ranks, default {DEFAULT_NPROC}); {visible}{asked}.\n"
            f"Without them, the CPU tour checks the op on gloo ranks: python -m cookbook.bench.tp --tour")


def _torchrun(nproc: int, argv: list[str], env: dict) -> int:
    """This module on `nproc` local ranks under torchrun, with `env` added to the environment."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "cookbook.bench.tp", *argv]
    print("$", shlex.join(cmd), flush=True)
    return subprocess.run(cmd, env={**os.environ, **env}).returncode


# --------------------------------------------------------------------------------------------
# One rank's measurements.
# --------------------------------------------------------------------------------------------
def time_per_call(fn, arg_sets, calls: int) -> tuple[list[float], str]:
    """Per-call microseconds of `calls` calls of fn per replay (graph, or a loop if capture fails)."""
    bench.warm_up(fn, arg_sets)
    graph, why_loop = bench.capture(fn, arg_sets, calls)
    replay = graph.replay if graph is not None else (lambda: bench.launch_calls(fn, arg_sets, calls))
    for _ in range(WARMUP_REPLAYS):
        replay()
    per_replay = []
    for _ in range(TIMED_REPLAYS):  # each replay alone, after a barrier: every rank starts together
        dist.barrier()
        torch.cuda.synchronize()
        per_replay += bench.time_replays(replay, 1)
    return [us / calls for us in per_replay], ("loop: " + why_loop if why_loop else "graph")


def time_back_to_back(fn, arg_sets) -> float:
    """Per-call microseconds as SGLang's benchmark measured them (module docstring): LAYERS calls
    over LAYERS input sets in one graph, replayed B2B_REPLAYS times back to back."""
    layers = [arg_sets[i % len(arg_sets)] for i in range(LAYERS)]
    for _ in range(B2B_WARMUP_CALLS):
        fn(*layers[0])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in layers:
            fn(*args)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(B2B_REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * bench.US_PER_MS / (B2B_REPLAYS * LAYERS)


def slowest_rank(summary: dict) -> dict:
    """The summary of the rank whose median is largest (every rank returns the same dict)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, summary)
    return max(everyone, key=lambda s: s["median_us"])


def make_sets(shape, dtype, rank, world, count):
    t, q_width, k_width = shape
    full = tp.make_full_inputs(t, q_width, k_width, dtype, "cuda", seed=0)
    sets = []
    for i in range(count):
        shard = tp.shard_of(full, rank, world)
        a = tp.check_inputs(**shard, eps=bench.EPS, weight_offset=bench.WEIGHT_OFFSET, rounding="fused")
        sets.append((a, shard))
    return full, sets


def check_once(impl, full, rank, world, dtype) -> str:
    """"" if one call on fresh shards agrees with the gathered reference, else the report."""
    shard = tp.shard_of(full, rank, world)
    a = tp.check_inputs(**shard, eps=bench.EPS, weight_offset=bench.WEIGHT_OFFSET, rounding="fused")
    impl.build()(*bench.positional(a))
    expected = tp.expected(full, rank, world, bench.EPS, bench.WEIGHT_OFFSET, "fused")
    bad = []
    for name in ("q_shard", "k_shard"):
        exact, rounded = expected[name]
        r = agreement(f"{impl.name}:{name}", shard[name], exact, rounded, "fused", tp.TOLERANCES[dtype])  # on the GPU
        if not r.ok:
            bad.append(r.message)
    everyone = [None] * world
    dist.all_gather_object(everyone, bad)
    return "; ".join(f"rank {r}: {m}" for r, msgs in enumerate(everyone) for m in msgs)


def extra_rows(shape, sets, group):
    """(name, fn, per-set args) of the communication-only rows and the single-GPU baseline."""
    t = shape[0]
    rows = []
    sums = [torch.ones((t, tp.NUM_TENSORS), dtype=torch.float32, device="cuda") for _ in sets]
    rows.append((NCCL_SUMS, lambda s: dist.all_reduce(s, group=group), [(s,) for s in sums]))
    try:
        from torch.distributed import _symmetric_memory as symm_mem

        buf = symm_mem.empty((max(t, 1), tp.NUM_TENSORS), dtype=torch.float32, device="cuda")
        symm_mem.rendezvous(buf, group.group_name)
        one_shot = torch.ops.symm_mem.one_shot_all_reduce
        rows.append((SYMM_MEM_SUMS, lambda b: one_shot(b, "sum", group.group_name), [(buf,)]))
    except Exception as error:  # noqa: BLE001 - reported in the table
        rows.append((SYMM_MEM_SUMS, error, None))
    local = registry.fastest("cross_head_norm").fn
    rows.append((LOCAL_SHARD, local, [(a.q, a.k, a.q_weight, a.k_weight, a.eps, a.weight_offset, a.rounding)
                                      for a, _ in sets]))
    return rows


class SGLangPeer:
    """SGLang's fused TP kernel with the registry's calling convention (`check_once` and the timing
    call it like ours): the shards of one MiniMax-like shape, calls of at most `max_tokens`."""

    name = SGLANG_TP

    def __init__(self, shape, dtype, world: int, max_tokens: int):
        self.shape, self.dtype, self.world, self.max_tokens = shape, dtype, world, max_tokens

    def build(self):
        from cookbook.peers import sglang_tp

        _, q_width, k_width = self.shape
        fn = sglang_tp.kernel(self.dtype, self.world, q_width, k_width, self.max_tokens)

        def run(q, k, q_weight, k_weight, eps, weight_offset, rounding, group):
            if weight_offset != 0.0 or rounding != "fused":
                raise ValueError("SGLang's kernel computes weight_offset=0 in the fused rounding order only")
            fn(q, k, q_weight, k_weight, eps)

        return run


def calls_for(call_us: float, sets: int) -> int:
    return bench.calls_per_replay(sets, call_us) if call_us > 0 else sets


def build_extensions(only=None) -> None:
    """Every CUDA C extension of the rows to run, built at once (in parallel, each rank into the
    same cache: the first builds, the others wait for its lock and load it)."""
    from cookbook import cuda

    wanted = [impl.extension for impl in registry.implementations(OP, ("cuda", "tuned"))
              if only is None or impl.name in only]
    for name, result in cuda.build(wanted).items():
        if isinstance(result, Exception):
            print(f"{name}: not built ({bench.error_text(result)})", flush=True)


def run_shape(shape, dtype, rank, world, group, meta, only=None, timing=GRAPH, max_tokens=None) -> list[dict]:
    t, q_width, k_width = shape
    label = f"T={t} q={q_width} k={k_width} (shard {q_width // world}/{k_width // world})"
    elem = torch.empty((), dtype=dtype).element_size()
    bytes_per_call = 2 * t * (q_width + k_width) // world * elem
    budget = int(torch.cuda.get_device_properties(0).total_memory * MEMORY_BUDGET_FRACTION)
    count = LAYERS if timing == BACK_TO_BACK else \
        bench.rotating_set_count(bytes_per_call, bytes_per_call, meta["l2_bytes"], budget)
    full, sets = make_sets(shape, dtype, rank, world, count)
    rows = []
    candidates = [(impl.name, impl, None) for impl in registry.implementations(OP)]
    candidates.append((SGLANG_TP, SGLangPeer(shape, dtype, world, max(max_tokens or t, t)), None))
    candidates += [(name, fn, args) for name, fn, args in extra_rows(shape, sets, group)]
    for name, target, per_set in [c for c in candidates if only is None or c[0] in only]:
        row = {"op": OP, "shape": list(shape), "label": label, "impl": name, "median_us": None, "p20_us": None,
               "p80_us": None, "method": "", "error": ""}
        try:
            if isinstance(target, Exception):
                raise target
            if per_set is None:  # a registered implementation or SGLang's: check it first
                row["error"] = check_once(target, full, rank, world, dtype)
                if row["error"]:
                    rows.append(row)
                    continue
                fn, per_set = target.build(), [bench.positional(a) for a, _ in sets]
            else:
                fn = target
            if timing == BACK_TO_BACK:
                dist.barrier()
                everyone = [None] * world
                dist.all_gather_object(everyone, time_back_to_back(fn, per_set))
                row.update(median_us=everyone[0], slowest_us=max(everyone), method=f"{B2B_REPLAYS} x {LAYERS} calls")
            else:
                estimate, _ = time_per_call(fn, per_set, len(per_set))
                call_us = max(bench.percentile(estimate, 50), 0.0)
                everyone = [None] * world
                dist.all_gather_object(everyone, call_us)  # one K for every rank: the graphs must match
                per_call, method = time_per_call(fn, per_set, calls_for(max(everyone), len(per_set)))
                row.update(slowest_rank(bench.summarize(per_call)), method=method)
        except Exception as error:  # noqa: BLE001 - one failing row must not end the run
            row["error"] = bench.error_text(error)
        if rank == 0:  # (`shown`, not `timing`: the loop's next row must still see the timing mode)
            shown = f"{row['median_us']:.2f} us" if row["median_us"] is not None else row["error"]
            print(f"{label:44s} {name:28s} {shown}", flush=True)
        rows.append(row)
    return rows


def table(rows, timing=GRAPH) -> str:
    local = {tuple(r["shape"]): r["median_us"] for r in rows if r["impl"] == LOCAL_SHARD}
    body = []
    for r in rows:
        base = local.get(tuple(r["shape"]))
        vs_local = f"{r['median_us'] / base:.2f}x" if r["median_us"] and base else "-"
        spread = f"{r['slowest_us']:.2f}" if timing == BACK_TO_BACK else f"{r['p20_us']:.2f}-{r['p80_us']:.2f}"
        timing_cells = [f"{r['median_us']:.2f}", spread, vs_local, r["method"]] \
            if r["median_us"] is not None else ["-", "-", "-", "-"]
        error = (r["error"][: bench.MAX_CELL_CHARS] + "...") if len(r["error"]) > bench.MAX_CELL_CHARS else r["error"]
        body.append([r["label"], r["impl"], *timing_cells, error or "ok"])
    head = ["rank 0's mean us", "slowest rank's mean us"] if timing == BACK_TO_BACK else \
        ["median us (slowest rank)", "p20-p80 us"]
    return bench.markdown_table(["shape", "impl", *head, "x local shard", "timed by", "check"], body)


def timed_at(rows, tokens: int) -> dict:
    """{impl: median us} of the MiniMax-M2 rows at `tokens` that were timed (a row whose check
    failed has no time)."""
    shape = [tokens, *MINIMAX_WIDTHS]
    return {r["impl"]: r["median_us"] for r in rows if r["shape"] == shape and r["median_us"] is not None}


def fastest_version(timed: dict):
    """(name, us) of the fastest CUDA C version in `timed_at`'s answer, or None."""
    versions = {name: us for name, us in timed.items() if name.startswith("cuda_v")}
    return min(versions.items(), key=lambda item: item[1], default=None)


def published_comparison(rows, meta) -> str:
    """The MiniMax-M2 rows at PUBLISHED_TP4_H200_US's token counts beside those figures, for the
    latest CUDA C version, the fastest CUDA C version of each shape and the local shard."""
    latest = registry.fastest(OP).name  # what backend="cuda" runs
    body = []
    for tokens, published in PUBLISHED_TP4_H200_US.items():
        mine = timed_at(rows, tokens)
        best = fastest_version(mine)
        if latest not in mine:
            continue
        body.append([str(tokens), f"{published:.1f}", f"{mine[latest]:.2f} ({mine[latest] / published:.2f}x)",
                     f"{best[0]} {best[1]:.2f}" if best else "-",
                     f"{mine[LOCAL_SHARD]:.2f}" if LOCAL_SHARD in mine else "-"])
    if not body:
        return ""
    like = ("the same GPUs and TP" if meta["world"] == 4 and "H200" in meta["gpu"] else
            f"not like for like: {meta['world']} x {meta['gpu']} here")
    return "\n".join([
        f"Against {PUBLISHED_BY} on 4 x H200 at MiniMax-M2's widths ({like}; this page's timing: "
        f"{'the same method' if meta['timing_mode'] == BACK_TO_BACK else 'graph replays after a barrier, the slowest rank'}):",
        "",
        bench.markdown_table(["tokens", "published us", f"{latest} us (x published)", "fastest CUDA C version us",
                              "local shard us"], body), ""])


def sglang_package() -> str:
    from cookbook.peers import sglang_tp

    return sglang_tp.package()


def sglang_comparison(rows) -> str:
    """SGLang's fused TP kernel against the latest CUDA C version (what backend="cuda" runs) and the
    fastest CUDA C version, at every shape both were timed in this run."""
    latest = registry.fastest(OP).name  # what backend="cuda" runs
    body = []
    for label in dict.fromkeys(r["label"] for r in rows):
        timed = {r["impl"]: r["median_us"] for r in rows if r["label"] == label and r["median_us"] is not None}
        if SGLANG_TP not in timed or latest not in timed:
            continue
        theirs, best = timed[SGLANG_TP], fastest_version(timed)
        body.append([label, f"{theirs:.2f}", f"{timed[latest]:.2f}", f"{timed[latest] / theirs:.2f}",
                     f"{best[0]} {best[1]:.2f} ({best[1] / theirs:.2f})" if best else "-"])
    if not body:
        why = next((r["error"] for r in rows if r["impl"] == SGLANG_TP and r["error"]), "")
        return f"SGLang's fused TP kernel: not timed in this run{': ' + why if why else ''}.\n" if why else ""
    return "\n".join(["Against SGLang's fused TP kernel, timed in this run on the same GPUs and inputs:", "",
                      bench.markdown_table(["shape", "SGLang us", f"{latest} us", f"{latest} / SGLang",
                                            "fastest CUDA C version us (/ SGLang)"], body), ""])


def page_stem(gpu_slug: str, world: int, timing: str = GRAPH) -> str:
    """The name of a results page without its suffix: `<op>_<gpu>x<tp>[_back_to_back]`."""
    return f"{OP}_{gpu_slug}x{world}" + (f"_{BACK_TO_BACK}" if timing == BACK_TO_BACK else "")


def write_results(rows, meta, out: Path, results_dir: Path | None, quiet: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{OP}_results.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1))
    text = table(rows, meta["timing_mode"])
    comparison = "\n".join(part for part in (sglang_comparison(rows), published_comparison(rows, meta)) if part)
    if not quiet:
        print(f"\n{OP} ({meta['dtype']}) on {meta['world']} x {meta['gpu']}\n{text}\n{comparison}")
    if results_dir is None:
        return
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = page_stem(meta["gpu_slug"], meta["world"], meta["timing_mode"])
    page = [
        f"# {OP} on {meta['world']} x {meta['gpu']} ({meta['dtype']}, TP={meta['world']})",
        "",
        "Written by the benchmark: do not edit by hand, run the command again.",
        "",
        f"- GPUs: {meta['world']} x {meta['gpu']} ({meta['sm_count']} SMs each); torch {meta['torch']}, "
        f"CUDA {meta['cuda']}, NCCL {meta['nccl']}; NVLink multicast off",
        f"- date: {meta['date']}; commit: {meta['commit']}",
        f"- command: `{meta['command']}`",
        f"- timing: {meta['timing']}",
        f"- x local shard: the row's time over the same shard's single-GPU `cross_head_norm` "
        f"({LOCAL_SHARD}: no communication)",
        *([f"- {SGLANG_TP}: {sglang_package()}"] if any(r["impl"] == SGLANG_TP for r in rows) else []),
        "",
        text,
        "",
        comparison,
    ]
    (results_dir / f"{stem}.md").write_text("\n".join(page))
    (results_dir / f"{stem}.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1))
    if not quiet:
        print(f"wrote {results_dir / (stem + '.md')}\n{bench.pages_note(results_dir)}")


# --------------------------------------------------------------------------------------------
# The CPU tour of the collective: gloo ranks, the reference, the Numba pipeline (simulator) and the
# all-gather baseline on tiny shapes, each checked against the gathered float64 reference.
# --------------------------------------------------------------------------------------------
def tour(rank: int, world: int, dtypes=bench.TOUR_DTYPES) -> int:
    group = dist.group.WORLD
    impls = [impl for impl in registry.implementations(OP) if impl.unavailable("cpu") is None]
    body, failed = [], 0
    for t, q_width, k_width in tp.SIM_SHAPES:
        q_width, k_width = q_width * world // 2, k_width * world // 2  # shard widths as at tp=2
        for dtype in dtypes:
            for rounding in bench.ROUNDINGS:
                full = tp.make_full_inputs(t, q_width, k_width, dtype, seed=bench.TOUR_SEED)
                want = tp.expected(full, rank, world, bench.EPS, bench.WEIGHT_OFFSET, rounding)
                for impl in impls:
                    shard = tp.shard_of(full, rank, world)
                    try:
                        a = tp.check_inputs(**shard, eps=bench.EPS, weight_offset=bench.WEIGHT_OFFSET,
                                            rounding=rounding, group=group)
                        impl.fn(*bench.positional(a))
                        verdicts = [agreement(f"{impl.name}:{n}", shard[n], *want[n], rounding, tp.TOLERANCES[dtype])
                                    for n in ("q_shard", "k_shard")]
                        mine = (all(v.ok for v in verdicts), max(v.max_ulp for v in verdicts),
                                "; ".join(v.message for v in verdicts if not v.ok))
                    except Exception as error:  # noqa: BLE001 - reported in the table
                        mine = (False, None, bench.error_text(error))
                    everyone = [None] * world
                    dist.all_gather_object(everyone, mine)
                    ok = all(r[0] for r in everyone)
                    worst = max((r[1] for r in everyone if r[1] is not None), default=None)
                    failed += not ok
                    body.append([f"T={t} q={q_width} k={k_width}", bench.dtype_name(dtype), rounding, impl.name,
                                 "-" if worst is None else f"{worst:.2g}",
                                 "ok" if ok else next(r[2] for r in everyone if not r[0])[: bench.MAX_CELL_CHARS]])
    if rank == 0:
        print(f"\n{OP} at tp={world} on gloo (CPU ranks; Numba under its simulator): every rank's shard "
              f"against its columns of the gathered float64 reference")
        print(bench.markdown_table(["full shape", "dtype", "rounding", "impl", "max ulp (any rank)", "agreement"], body))
        print(f"{len(body) - failed} of {len(body)} runs agree on every rank." + (" FAILURES above." if failed else ""))
    return 1 if failed else 0


def launch_tour(nproc: int = DEFAULT_NPROC, dtype: str | None = None) -> int:
    """The CPU tour under torchrun: `nproc` gloo ranks on this machine, in `dtype` (None: the tour's
    dtypes, float32 and bfloat16)."""
    path = os.pathsep.join(p for p in (str(bench.REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    argv = ["--tour", *(["--dtype", dtype] if dtype else [])]
    return _torchrun(nproc, argv, {"NUMBA_ENABLE_CUDASIM": "1", "PYTHONPATH": path})


def metadata(command: str, dtype, world: int, timing_mode: str = GRAPH) -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name, "gpu_slug": bench.gpu_slug(props.name), "sm_count": props.multi_processor_count,
        "l2_bytes": bench.l2_bytes(), "world": world, "torch": torch.__version__, "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": bench.git_commit(), "command": command, "dtype": bench.dtype_name(dtype),
        "sources": sources.fingerprints(["tp_qk_norm"]),
        "timing_mode": timing_mode,
        "timing": (f"median of {TIMED_REPLAYS} CUDA-graph replays (each after a cross-rank barrier, "
                   f"{WARMUP_REPLAYS} warm-up replays), per call = replay / calls per replay, slowest rank"
                   if timing_mode == GRAPH else
                   f"SGLang's benchmark's method: {B2B_WARMUP_CALLS} eager calls, a CUDA graph of {LAYERS} calls "
                   f"over {LAYERS} input sets, {B2B_REPLAYS} replays back to back between two CUDA events (no "
                   f"barrier), per call = elapsed / {B2B_REPLAYS * LAYERS}; rank 0's mean, and the slowest rank's"),
    }


def token_counts(text: str) -> list[int]:
    """`--tokens`: comma-separated token counts, each a positive integer."""
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers (e.g. 1,128,2048), got {text!r}")
    return counts


def bench_shapes(which: str, counts: list[int] | None = None) -> list[list[int]]:
    """The [T, q_hidden, k_hidden] shapes of a run: `--shapes` picks from tp.BENCH_SHAPES and `--tokens`
    keeps those token counts; with `--shapes minimax` it gives MiniMax-M2's widths at exactly these counts
    (any count: the token counts between the bench's, where a dispatch threshold falls)."""
    if which == MINIMAX:
        if counts:
            return [[t, *MINIMAX_WIDTHS] for t in counts]
        return [sh for sh in tp.BENCH_SHAPES if tuple(sh[1:]) == MINIMAX_WIDTHS]
    if which == DECODE:
        shapes = [sh for sh in tp.BENCH_SHAPES if sh[0] <= DECODE_TOKENS]
    else:
        shapes = bench.select_shapes(tp.BENCH_SHAPES, which)
    return [sh for sh in shapes if counts is None or sh[0] in counts]


def arguments() -> argparse.ArgumentParser:
    """The command line of ``python -m cookbook.bench.tp``."""
    parser = argparse.ArgumentParser(prog="python -m cookbook.bench.tp",
                                     description=f"The benchmark of {OP} on 2 or more CUDA GPUs (one rank per GPU, "
                                                 "under torchrun), or its CPU tour on gloo ranks (--tour).",
                                     epilog="Exit status: 0 every implementation agrees, 1 one does not, 2 this "
                                            "machine cannot run what was asked (or bad arguments).")
    parser.add_argument("--dtype", default=None, choices=tuple(bench.DTYPES),
                        help="default: bfloat16 (the tour: float32 and bfloat16)")
    parser.add_argument("--shapes", default="full", choices=(*bench.SHAPE_CHOICES, DECODE, MINIMAX),
                        help=f"quick: first, middle and last shapes; {DECODE}: the shapes of at most {DECODE_TOKENS} "
                             f"tokens; {MINIMAX}: MiniMax-M2's widths at every token count")
    parser.add_argument("--tokens", default=None, type=token_counts,
                        help=f"only these token counts, comma-separated (with --shapes {MINIMAX}: any count)")
    parser.add_argument("--timing", default=GRAPH, choices=(GRAPH, BACK_TO_BACK),
                        help=f"{BACK_TO_BACK}: SGLang's benchmark's method (the module docstring)")
    parser.add_argument("--out", default=bench.DEFAULT_OUT, help="the run's JSON (default: %(default)s)")
    parser.add_argument("--results-dir", default=None,
                        help=f"where the results pages go (default: <out>/pages; the pages of record that the docs "
                             f"link to: --results-dir {bench.PAGES_OF_RECORD})")
    parser.add_argument("--no-results", action="store_true")
    parser.add_argument("--nproc", type=int, default=None,
                        help=f"ranks (GPUs; the tour: gloo ranks) when not already under torchrun "
                             f"(default: {DEFAULT_NPROC})")
    parser.add_argument("--impls", default=None, help="comma-separated rows to run (default: all)")
    parser.add_argument("--dump-after", type=float, default=None,
                        help="print every rank's Python stack after this many seconds (where a run that hangs waits)")
    parser.add_argument("--command", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tour", action="store_true", help="the CPU tour on gloo ranks (no timing)")
    return parser


def main(argv=None) -> int:
    parser = arguments()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    known = [impl.name for impl in registry.implementations(OP)] + [SGLANG_TP, NCCL_SUMS, SYMM_MEM_SUMS, LOCAL_SHARD]
    unknown = sorted(set(args.impls.split(",")) - set(known)) if args.impls else []
    if unknown:
        parser.error(f"--impls: unknown row(s) {unknown}; expected names from {known}")
    if args.tour:
        if not under_torchrun():
            return launch_tour(args.nproc or DEFAULT_NPROC, args.dtype)
        dist.init_process_group("gloo")
        try:
            dtypes = (bench.resolve_dtype(args.dtype),) if args.dtype else bench.TOUR_DTYPES
            return tour(dist.get_rank(), dist.get_world_size(), dtypes)
        finally:
            dist.destroy_process_group()
    if not under_torchrun():
        forward = [a for i, a in enumerate(argv)  # drop --nproc N / --nproc=N: torchrun sets the ranks
                   if not a.startswith("--nproc") and not (i > 0 and argv[i - 1] == "--nproc")]
        command = shlex.join(["python", "-m", "cookbook.bench.tp", *argv])
        return launch(args.nproc, [*forward, "--command", args.command or command])
    if args.dump_after:
        faulthandler.dump_traceback_later(args.dump_after)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    dtype = bench.resolve_dtype(args.dtype or bench.DEFAULT_DTYPE)
    meta = metadata(args.command or "python -m cookbook.bench.tp", dtype, world, args.timing)
    build_extensions(args.impls.split(",") if args.impls else None)
    rows = []
    try:
        shapes = bench_shapes(args.shapes, args.tokens)
        for shape in shapes:  # the page is rewritten after every shape: a run cut short keeps what it measured
            rows += run_shape(shape, dtype, rank, world, group, meta, args.impls.split(",") if args.impls else None,
                              args.timing, max_tokens=max(s[0] for s in shapes))
            torch.cuda.empty_cache()
            if rank == 0:
                write_results(rows, meta, Path(args.out),
                              None if args.no_results else bench.resolve_results_dir(args.out, args.results_dir),
                              quiet=shape != shapes[-1])
    finally:
        dist.barrier()
        dist.destroy_process_group()
    failed = [r for r in rows if r["error"] and r["impl"] in {i.name for i in registry.implementations(OP)}]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
