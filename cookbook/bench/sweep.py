"""The GPU benchmark: for every op, every shape of its contract's ``BENCH_SHAPES`` and every
implementation that can run there, agreement first (a fast wrong kernel has no speed), then
timing (`cookbook.bench.timing`), then tables, plots and results pages (`cookbook.bench.pages`)."""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

import torch

from cookbook import registry, sources
from cookbook.bench.common import (AGREEMENT_SEED, BENCH_ROUNDING, BYTES_PER_GB, COMPILED, DEFAULT_DTYPE, DEVICE,
                                   EAGER, GB_PER_TB, MIB, call_by_name, checked, dtype_name, error_text, expected_outputs,
                                   positional, resolve_dtype, resolve_ops, run_and_compare, select_shapes,
                                   split_available)
from cookbook.bench import peers as bench_peers
from cookbook.bench.pages import ROW_FIELDS, metadata, write_outputs
from cookbook.bench.timing import (MEMORY_FRACTION, copy_bandwidth_gb_per_s, l2_bytes, measure, rotating_set_count,
                                   storage_bytes, summarize)
from cookbook.bench.timing import COPY_BYTES

class Progress:
    """A tqdm bar on a terminal with tqdm installed, else one printed line per step (a log file
    or a captured output reads better line by line than as carriage-return redraws)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0
        self._bar = None
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self._bar = tqdm(total=total, unit="case", dynamic_ncols=True)

    def begin(self, what: str) -> None:
        if self._bar is not None:
            self._bar.set_description_str(what)
        else:
            print(f"[{self.done + 1}/{self.total}] {what}", flush=True)

    def end(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(1)

    def write(self, message: str) -> None:
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def fresh_callable(impl):
    """Peers are built anew for every shape: a torch.compile object per shape, compiled from
    scratch (Dynamo is reset so earlier shapes count nothing towards its recompile limit)."""
    if impl.level == "peer":
        torch.compiler.reset()
        return impl.build()
    return impl.fn


def _bench_inputs(contract, shape, dtype, seed) -> dict:
    return contract.bench_case(shape, dtype, DEVICE, seed)[0]


@dataclasses.dataclass
class ShapeCase:
    """One benchmark shape, ready for every implementation."""

    contract: object  # the op's contract module
    base_row: dict  # the row fields every implementation shares
    arg_sets: list  # rotating input sets, each as positional arguments
    make_inputs: functools.partial  # fresh, seeded inputs for the agreement check
    expected: dict  # what the agreement check compares with (computed once, on the CPU)
    _oracles: dict | None = None  # every rounding order's reference, for the peers (on first use)

    def oracles(self) -> dict:
        if self._oracles is None:
            self._oracles = bench_peers.oracles_of(self.contract, self.make_inputs())
        return self._oracles


def prepare_shape(op, contract, shape, dtype) -> ShapeCase:
    """Rotating input sets sized to the L2 and to free memory, and the agreement oracle."""
    first, label = contract.bench_case(shape, dtype, DEVICE, 0)
    bytes_per_call = call_by_name(contract.bytes_moved, checked(contract, first))
    budget = int(torch.cuda.mem_get_info()[0] * MEMORY_FRACTION)
    sets = rotating_set_count(bytes_per_call, storage_bytes(first), l2_bytes(), budget)
    inputs = [first] + [_bench_inputs(contract, shape, dtype, seed) for seed in range(1, sets)]
    make = functools.partial(_bench_inputs, contract, shape, dtype, AGREEMENT_SEED)
    base = dict.fromkeys(ROW_FIELDS)
    base.update(op=op, dtype=dtype_name(dtype), label=label, shape=list(shape), bytes_moved=bytes_per_call,
                input_sets=sets)  # fmt: skip
    arg_sets = [positional(checked(contract, one)) for one in inputs]
    return ShapeCase(contract, base, arg_sets, make, expected_outputs(contract, make(), BENCH_ROUNDING))


def bench_shape(op, contract, shape, dtype, impls, copy_gb_per_s, progress, trace_dir=None,
                peer_records=None) -> list[dict]:  # fmt: skip
    """Check, then time, every implementation in `impls` on one shape; one row each, except the
    peers of other packages: a row where timed, and always a verdict record in `peer_records`."""
    case = prepare_shape(op, contract, shape, dtype)
    rows = []
    for impl in impls:
        progress.begin(f"{op} {case.base_row['label']} {impl.name}")
        trace = None if trace_dir is None else Path(trace_dir) / f"trace_{op}_{dtype_name(dtype)}_{impl.name}.json"
        if bench_peers.is_external(impl):
            row, record = bench_peers.bench_peer(case, impl, copy_gb_per_s, trace, progress)
            rows += [row] if row is not None else []
            if peer_records is not None:
                peer_records.append(record)
        else:
            rows.append(bench_impl(case, impl, copy_gb_per_s, trace, progress))
        progress.end()
    add_speedups(rows)
    return rows


def bench_impl(case: ShapeCase, impl, copy_gb_per_s, trace, progress) -> dict:
    """Agreement on fresh inputs, then (if it agrees) timing: one result row."""
    row = dict(case.base_row, impl=impl.name, level=impl.level, version=impl.version)
    where = f"{row['op']} {row['label']} {impl.name}"
    try:
        fn = fresh_callable(impl)
        verdict, _ = run_and_compare(case.contract, impl.name, fn, case.make_inputs(), case.expected, BENCH_ROUNDING)
        row.update(agrees=verdict.ok, max_ulp=verdict.max_ulp, agreement=verdict.message)
        if not verdict.ok:
            progress.write(f"!! {where} DISAGREES, not timed: {verdict.message}")
            return row
        timing = measure(fn, case.arg_sets, trace)
    except Exception as error:  # a build or launch failure: reported, and the others go on
        row.update(agrees=False, error=error_text(error))
        progress.write(f"!! {where} FAILED: {row['error']}")
        return row
    row.update(summarize(timing.per_call_us), method=timing.method, calls_per_replay=timing.calls_per_replay)
    if timing.note:
        row["note"] = f"not capturable, timed as a launch loop: {timing.note}"
    row["gb_per_s"] = row["bytes_moved"] / (row["median_us"] * 1e-6) / BYTES_PER_GB
    row["pct_of_copy"] = 100 * row["gb_per_s"] / copy_gb_per_s
    return row


def add_speedups(rows) -> None:
    """x vs eager / compile / tuned: the baseline's median over this row's (> 1: faster); the
    tuned baseline is what backend="cuda" runs (registry.fastest)."""
    medians = {row["impl"]: row["median_us"] for row in rows if row["median_us"]}
    for row in rows:
        if not row["median_us"]:
            continue
        tuned = registry.fastest(row["op"]).name
        for column, baseline in (("x_vs_eager", EAGER), ("x_vs_compile", COMPILED), ("x_vs_tuned", tuned)):
            if baseline in medians:
                row[column] = medians[baseline] / row["median_us"]


def run(ops=None, dtype=DEFAULT_DTYPE, shapes="full", out="bench_out", *, profile=False,
        results_dir="docs/results", write_results=True, command=None, impls=None, tag=None) -> list[dict]:  # fmt: skip
    """Benchmark every registered implementation on the GPU; returns the result rows (dicts with
    the keys of ROW_FIELDS) and writes them, tables and plots to `out` (and, with
    `write_results`, the docs pages to `results_dir`). `impls` keeps only the implementations it
    names (`select_impls`); `tag` names the pages `<op>_<gpu>_<tag>` so a partial sweep never
    replaces the full one."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench.run needs a CUDA GPU; on a CPU, bench.tour() checks the implementations")
    dtype = resolve_dtype(dtype)
    ops = [op for op in resolve_ops(ops) if op not in registry.DISTRIBUTED_OPS]  # collectives: cookbook.bench.tp
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = _plan(ops, shapes, impls)
    copy_gb_per_s = copy_bandwidth_gb_per_s()
    print(f"device-to-device copy ({COPY_BYTES // MIB} MiB, graph replay): {copy_gb_per_s / GB_PER_TB:.2f} TB/s")
    progress = Progress(sum(len(shape_list) * len(impls) for _, _, shape_list, impls in plan))
    rows, peer_records = [], []
    for op, contract, shape_list, impls in plan:
        profiled = _largest_shape(contract, shape_list, dtype) if profile else None
        for shape in shape_list:
            trace_dir = out if shape == profiled else None
            rows += bench_shape(op, contract, shape, dtype, impls, copy_gb_per_s, progress, trace_dir, peer_records)
            torch.cuda.empty_cache()  # the rotating sets of this shape are garbage now
    progress.close()
    meta = metadata(command or f"cookbook.bench.run(ops={ops}, dtype={dtype_name(dtype)}, shapes={shapes!r})",
                    copy_gb_per_s, dtype)
    meta["sources"] = sources.fingerprints(dict.fromkeys(row["op"] for row in rows))  # what the pages show
    if tag:
        meta["tag"] = tag
    if peer_records:  # peers of other packages ran: their versions and verdicts go on the pages
        meta["peers"] = bench_peers.peer_metadata(peer_records)
    write_outputs(rows, meta, out, Path(results_dir) if write_results else None)
    return rows


def select_impls(op, names) -> list:
    """The implementations of `op` that `names` names: an implementation's name, a level
    ("peer", "tuned"), or "fastest" (what `backend="cuda"` runs). None: all of them."""
    if names is None:
        return registry.implementations(op)
    fastest = registry.fastest(op).name
    return [impl for impl in registry.implementations(op)
            if impl.name in names or impl.level in names or ("fastest" in names and impl.name == fastest)]


def _plan(ops, shapes, impls=None) -> list[tuple]:
    """[(op, contract, shapes, runnable implementations)]; prints what will not run, and why
    (peers whose package is not installed: one line for the whole run)."""
    plan, not_installed = [], []
    for op in ops:
        contract = registry.contract(op)
        wanted = {impl.name for impl in select_impls(op, impls)}
        runnable, skipped = split_available(op, DEVICE)
        runnable = [impl for impl in runnable if impl.name in wanted]
        skipped = [(impl, reason) for impl, reason in skipped if impl.name in wanted]
        runnable, broken = build_cuda_kernels(op, runnable)
        for impl, reason in skipped + broken:
            if bench_peers.is_external(impl) and bench_peers.guard.is_not_installed(reason):
                not_installed.append((impl, reason))
            else:
                print(f"{op}: not benchmarked: {impl.name} ({reason})")
        plan.append((op, contract, select_shapes(contract.BENCH_SHAPES, shapes), runnable))
    note = bench_peers.not_installed_note(not_installed)
    if note:
        print(note)
    return plan


def build_cuda_kernels(op, impls) -> tuple[list, list]:
    """Build the op's CUDA C kernels before any timing, every extension at once, in parallel: a
    build that fails is reported once, not once per shape. (runnable, [(impl, why not)])."""
    compiled = [impl for impl in impls if impl.level in registry.COMPILED_LEVELS]
    if not compiled:
        return impls, []
    from cookbook import cuda

    print(f"{op}: building (or loading the cached) CUDA C kernels ...", flush=True)
    failed = {}
    extensions = [impl.extension for impl in compiled if impl.extension is not None]
    for name, result in cuda.build(extensions).items():
        if isinstance(result, Exception):
            failed[name] = result
    if len(extensions) < len(compiled):  # an op still built as one extension
        try:
            cuda.load(op)
        except Exception as error:
            failed[op] = error
    broken = []
    for impl in compiled:
        error = failed.get(impl.extension.name if impl.extension is not None else op)
        if error is not None:
            print(f"!! {op}: the CUDA C build of {impl.name} failed:\n{error}", file=sys.stderr, flush=True)
            broken.append((impl, f"the CUDA C build failed: {error_text(error)}"))
    failed_impls = {impl for impl, _ in broken}
    return [impl for impl in impls if impl not in failed_impls], broken


def _largest_shape(contract, shapes, dtype):
    """The shape that moves the most bytes (inputs built on the meta device: no memory)."""
    def bytes_of(shape):
        return call_by_name(contract.bytes_moved, checked(contract, contract.bench_case(shape, dtype, "meta")[0]))

    return max(shapes, key=bytes_of)
