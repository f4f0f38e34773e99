"""One benchmark harness for every op: side-by-side profiling on a GPU, and a CPU tour.

On a GPU (`run`, `python -m cookbook bench`), for every op in the registry, every shape of its
contract's ``BENCH_SHAPES`` and every implementation that can run there:

1. **Agreement first.** One call on fresh inputs, compared with the contract's float64 value
   (`cookbook.testing.agreement`, rounding="fused"). An implementation that disagrees is reported
   loudly and not timed: a fast wrong kernel has no speed.
2. **Rotating input sets.** N copies of the inputs that together move at least
   ``L2_FLUSH_FACTOR`` times the L2 cache per pass, so no call finds its inputs still in L2 from
   the previous call on the same set.
3. **CUDA-graph replay.** K calls cycling through the N sets are captured once in a CUDA graph
   and replayed; each replay is timed with CUDA events and per-call time = replay time / K
   (median, p20, p80). Python launch overhead vanishes, as in an engine that replays graphs. An
   implementation that cannot be captured is timed as a plain loop of K launches instead
   (``method: "loop"``): that time includes its launch overhead.
4. **The copy ceiling, in the same run.** A device-to-device copy of ``COPY_BYTES``, timed the
   same way. Every row reports GB/s from the contract's bytes model and percent of that copy.

On a CPU (`tour`, `python -m cookbook tour`, and `bench` without a GPU): every implementation
that runs on a CPU (the PyTorch reference, the Numba kernels under Numba's CUDA simulator) on the
contract's tiny ``SIM_SHAPES``, float32 and bfloat16, both roundings, each checked for agreement.
Simulator timings mean nothing: every GPU thread runs as a Python thread.

Importing this module imports neither Numba nor the CUDA C kernels; both load on first
use, so the simulator can still be switched on after importing it.
"""

from __future__ import annotations

import csv
import dataclasses
import datetime
import functools
import importlib.metadata
import inspect
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cookbook import registry
from cookbook.testing import Agreement, agreement

REPO_ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda"  # the benchmark's device: torch's current CUDA device

# The op arguments every benchmark and tour call uses (the contract defaults).
EPS = 1e-6
WEIGHT_OFFSET = 0.0
BENCH_ROUNDING = "fused"  # what engines run; the tour checks both roundings

# Seeds: the rotating sets use 0..N-1; the agreement check gets inputs no timed call touched.
AGREEMENT_SEED = 10_000
TOUR_SEED = 0

# The baselines of the speedup columns (registry names).
EAGER = "reference"
COMPILED = "torch_compile"

# Rotating input sets: one pass over them moves L2_FLUSH_FACTOR x the L2 cache, so by the time a
# set comes round again its lines have been evicted. At least MIN_INPUT_SETS (a set is never
# reused back to back), at most MAX_INPUT_SETS (tiny shapes would want thousands, and a graph per
# set pass that large only slows capture), and never more than MEMORY_FRACTION of free memory.
L2_FLUSH_FACTOR = 4
MIN_INPUT_SETS = 2
MAX_INPUT_SETS = 64
MEMORY_FRACTION = 0.25
FALLBACK_L2_BYTES = 64 << 20  # larger than any current GPU's L2, if torch cannot tell us

# Timing. Warm-up calls run on a side stream before capture (lazy initialization and compiles
# must not happen inside a graph). One replay runs at least TARGET_REPLAY_US where the calls
# allow it (event resolution is about 0.5 us; launch gaps between replays amortize), capped at
# MAX_CALLS_PER_REPLAY calls per graph.
WARMUP_CALLS = 3
ESTIMATE_REPLAYS = 3
WARMUP_REPLAYS = 10
TIMED_REPLAYS = 30
TARGET_REPLAY_US = 200.0
MAX_CALLS_PER_REPLAY = 1024
LOW_PERCENTILE, HIGH_PERCENTILE = 20, 80
US_PER_MS = 1e3
BYTES_PER_GB = 1e9
GB_PER_TB = 1e3

# The copy ceiling: COPY_BYTES read and COPY_BYTES written per call, far beyond any L2.
MIB = 1 << 20
COPY_BYTES = 256 * MIB

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_DTYPE = torch.bfloat16
TOUR_DTYPES = (torch.float32, torch.bfloat16)
ROUNDINGS = ("fused", "hf")
SHAPE_CHOICES = ("quick", "full")

PLOTS = {  # plot name -> (row column, y-axis label)
    "latency": ("median_us", "median time per call (us)"),
    "pct_of_copy": ("pct_of_copy", "% of device-to-device copy bandwidth"),
}
MAX_CELL_CHARS = 60  # error messages in a table cell are cut to this
PLOT_SIZE_INCHES = (7.0, 4.5)
# One line per implementation, told apart by colour (a qualitative map of 20 distinct colours, so
# that a sweep of every version does not repeat the default cycle's 10) and by a marker per level.
PLOT_COLORS = "tab20"
LEVEL_MARKERS = {"reference": "s", "numba": "^", "cuda": "o"}  # peers (torch_compile, ...): "D"
PLOT_DPI = 120

# Every bench row has these keys (the CSV columns), in this order.
ROW_FIELDS = (
    "op", "dtype", "label", "shape", "impl", "level", "version",
    "agrees", "max_ulp", "agreement", "error",
    "method", "input_sets", "calls_per_replay", "median_us", "p20_us", "p80_us",
    "bytes_moved", "gb_per_s", "pct_of_copy", "x_vs_eager", "x_vs_compile", "note",
)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Pure helpers (unit-tested on the CPU).
# --------------------------------------------------------------------------------------------
def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) of `values`, interpolating linearly between neighbours."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def summarize(per_call_us) -> dict:
    """Median and the p20..p80 spread of per-call times (microseconds)."""
    return {
        "median_us": percentile(per_call_us, 50),
        "p20_us": percentile(per_call_us, LOW_PERCENTILE),
        "p80_us": percentile(per_call_us, HIGH_PERCENTILE),
    }


_VENDOR_WORDS = {"nvidia", "geforce", "tesla", "quadro"}


def gpu_slug(device_name: str) -> str:
    """A short file-name tag for a GPU: the words up to the first model number, vendor dropped.

    "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA H200" -> "h200", "NVIDIA GeForce RTX 4090" -> "rtx4090".
    """
    words = [w for w in re.split(r"[^a-z0-9]+", device_name.lower()) if w and w not in _VENDOR_WORDS]
    for i, word in enumerate(words):
        if any(c.isdigit() for c in word):
            return "".join(words[: i + 1])
    return "".join(words) or "gpu"


def rotating_set_count(bytes_per_call: int, bytes_per_set: int, l2_bytes: int, memory_budget: int) -> int:
    """How many input sets to rotate through (see the constants above); at least 1."""
    wanted = math.ceil(L2_FLUSH_FACTOR * l2_bytes / max(bytes_per_call, 1))
    count = min(max(wanted, MIN_INPUT_SETS), MAX_INPUT_SETS)
    fits = memory_budget // max(bytes_per_set, 1)
    return max(1, min(count, fits))


def calls_per_replay(input_sets: int, call_us: float) -> int:
    """K: whole passes over the input sets, enough for one replay to run TARGET_REPLAY_US."""
    most_passes = max(1, MAX_CALLS_PER_REPLAY // input_sets)
    pass_us = call_us * input_sets
    passes = most_passes if pass_us <= 0 else min(math.ceil(TARGET_REPLAY_US / pass_us), most_passes)
    return input_sets * max(passes, 1)


def select_shapes(all_shapes, choice: str) -> list:
    """ "full": every shape; "quick": the first, middle and last ones."""
    if choice == "full":
        return list(all_shapes)
    if choice == "quick":
        picks = sorted({0, len(all_shapes) // 2, len(all_shapes) - 1})
        return [all_shapes[i] for i in picks]
    raise ValueError(f"shapes: expected one of {SHAPE_CHOICES}, got {choice!r}")


def resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype: expected one of {list(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def markdown_table(headers, body) -> str:
    """A markdown table with padded columns (readable in a terminal too)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in line] for line in body]
    widths = [max(len(line[i]) for line in cells) for i in range(len(headers))]
    fmt = lambda line: "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(cells[0]), rule] + [fmt(line) for line in cells[1:]])


# --------------------------------------------------------------------------------------------
# Calling an implementation the registry's way, and checking what it wrote.
# --------------------------------------------------------------------------------------------
def checked(contract, inputs: dict, rounding: str = BENCH_ROUNDING):
    """The contract's checked arguments (views of the inputs, no copies)."""
    return contract.check_inputs(**inputs, eps=EPS, weight_offset=WEIGHT_OFFSET, rounding=rounding)


def positional(args) -> list:
    """Checked arguments in field order: every implementation is called as ``fn(*positional(args))``.
    (Not `dataclasses.astuple`: that deep-copies the tensors.)"""
    return [getattr(args, field.name) for field in dataclasses.fields(args)]


def call_by_name(fn, args):
    """Call a contract function (``bytes_moved``) with the checked fields it names."""
    return fn(**{name: getattr(args, name) for name in inspect.signature(fn).parameters})


def expected_outputs(contract, inputs: dict, rounding: str) -> dict:
    """The contract's ``expected`` for unmodified `inputs`, moved to the CPU once:
    {output name: (float64 exact value, Hugging Face-order reference or None)}."""
    expected = contract.expected(inputs, EPS, WEIGHT_OFFSET, rounding)
    return {name: tuple(None if t is None else t.cpu() for t in pair) for name, pair in expected.items()}


def compare(contract, impl_name: str, inputs: dict, expected: dict, rounding: str) -> Agreement:
    """Agreement of every output an implementation wrote in place (``inputs[name]``) with `expected`."""
    results = []
    for name, (exact, rounded) in expected.items():
        actual = inputs[name]
        tol = contract.TOLERANCES[actual.dtype]
        results.append(agreement(f"{impl_name}:{name}", actual, exact, rounded, rounding, tol))
    failed = [r.message for r in results if not r.ok]
    max_ulp = max(r.max_ulp for r in results)
    return Agreement(not failed, "; ".join(failed) or f"ok (max {max_ulp:.3g} ulp)", max_ulp)


def run_and_compare(contract, impl_name, fn, inputs, expected, rounding) -> tuple[Agreement, float]:
    """One call of `fn` on `inputs` (fresh, seeded like the ones `expected` came from):
    (agreement with `expected`, wall seconds of the call). The seconds are host time:
    meaningful only for synchronous (simulated or CPU) runs."""
    args = checked(contract, inputs, rounding)
    start = time.perf_counter()
    fn(*positional(args))
    seconds = time.perf_counter() - start
    return compare(contract, impl_name, inputs, expected, rounding), seconds


def resolve_ops(ops) -> list[str]:
    """The ops to run, each checked against the registry. Default: every registered op, the
    collective ones (registry.DISTRIBUTED_OPS) only where two GPUs can run them."""
    known = registry.ops()
    unknown = [op for op in ops or () if op not in known]
    if unknown:
        raise ValueError(f"unknown op(s) {unknown}: the registry has {known}")
    if ops:
        return list(ops)
    multi_gpu = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    return [op for op in known if multi_gpu or op not in registry.DISTRIBUTED_OPS]


def split_available(op: str, device) -> tuple[list, list]:
    """(implementations that run on `device`, [(implementation, why not)] for the others)."""
    runnable, skipped = [], []
    for impl in registry.implementations(op):
        reason = impl.unavailable(device)
        if reason is None:
            runnable.append(impl)
        else:
            skipped.append((impl, reason))
    return runnable, skipped


def _error_text(error: BaseException) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}"


# --------------------------------------------------------------------------------------------
# The CPU tour: every implementation a CPU can run, on tiny shapes, checked for agreement.
# --------------------------------------------------------------------------------------------
def request_simulator() -> None:
    """On a machine without a GPU, ask for Numba's CUDA simulator if Numba has not read its
    configuration yet (it reads NUMBA_ENABLE_CUDASIM once, at import; `kernels_numba.SIMULATOR`
    likewise). On a GPU machine the process keeps real Numba kernels: `python -m cookbook tour`
    turns the simulator on for its own process."""
    numba_configured = "numba.core.config" in sys.modules or "kernels_numba" in sys.modules
    if not numba_configured and not torch.cuda.is_available():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def tour(ops=None, shapes=None, dtypes=TOUR_DTYPES, roundings=ROUNDINGS, echo=print) -> list[dict]:
    """Run and check every CPU-runnable implementation; returns one row per call.

    `shapes` maps an op to its shapes (default: the contract's ``SIM_SHAPES``; each shape is the
    leading positional arguments of the contract's ``make_inputs``).
    """
    request_simulator()
    ops = [op for op in resolve_ops(ops) if op not in registry.DISTRIBUTED_OPS]  # collectives: cookbook.bench_tp
    rows = []
    for op in ops:
        contract = registry.contract(op)
        runnable, skipped = split_available(op, "cpu")
        op_rows = []
        for shape in (shapes or {}).get(op, contract.SIM_SHAPES):
            for dtype in dtypes:
                for rounding in roundings:
                    op_rows += _tour_case(op, contract, runnable, shape, dtype, rounding)
        echo(f"\n{op}: agreement on the CPU (timings are simulator wall time: they mean nothing)")
        echo(tour_table(op_rows))
        for row in op_rows:
            if not row["agrees"]:
                echo(f"  FAIL {row['label']} {row['dtype']} {row['rounding']}: {row['agreement']}")
        for impl, reason in skipped:
            echo(f"  not run here: {impl.name} ({reason})")
        rows += op_rows
    failed = sum(not row["agrees"] for row in rows)
    echo(f"\n{len(rows) - failed} of {len(rows)} runs agree with the contract." + (" FAILURES above." if failed else ""))
    echo(gpu_would_add(ops))
    return rows


def _tour_case(op, contract, impls, shape, dtype, rounding) -> list[dict]:
    make = functools.partial(contract.make_inputs, *shape, dtype=dtype, device="cpu", seed=TOUR_SEED)
    expected = expected_outputs(contract, make(), rounding)
    label = contract.bench_case(shape, dtype, "cpu")[1]  # tiny shapes: a cheap way to the label
    rows = []
    for impl in impls:
        row = dict(op=op, label=label, shape=list(shape), dtype=dtype_name(dtype), rounding=rounding,
                   impl=impl.name, level=impl.level, agrees=False, max_ulp=None, agreement="", wall_ms=None)
        try:
            verdict, seconds = run_and_compare(contract, impl.name, impl.fn, make(), expected, rounding)
            row.update(agrees=verdict.ok, max_ulp=verdict.max_ulp, agreement=verdict.message,
                       wall_ms=seconds * US_PER_MS)
        except Exception as error:  # report it in the table and go on with the others
            row.update(agreement=_error_text(error))
        rows.append(row)
    return rows


def tour_table(rows) -> str:
    headers = ["shape", "dtype", "rounding", "impl", "agreement", "wall ms (simulated)"]
    body = [
        [r["label"], r["dtype"], r["rounding"], r["impl"],
         r["agreement"] if r["agrees"] else "FAIL (below)",
         "-" if r["wall_ms"] is None else f"{r['wall_ms']:.1f}"]
        for r in rows
    ]  # fmt: skip
    return markdown_table(headers, body)


def gpu_would_add(ops) -> str:
    """What `python -m cookbook bench` adds on a CUDA GPU, named from the registry."""
    lines = ["\nOn a CUDA GPU, `python -m cookbook bench` also:"]
    for op in ops:
        gpu_only = [impl.name for impl in registry.implementations(op, ("cuda", "peer"))]
        lines.append(f"  - runs {op}'s {', '.join(gpu_only)} and its Numba kernels on the real GPU;")
    lines += [
        "  - checks each implementation on every benchmark shape, then times it by CUDA-graph replay",
        "    over rotating input sets (median, p20-p80), in GB/s and % of a device-to-device copy",
        "    measured in the same run, with speedups over PyTorch eager and torch.compile;",
        "  - writes results.csv, results.json and latency / %-of-copy plots to bench_out/, and the",
        "    results pages docs/results/<op>_<gpu>.md (with plots and JSON) that the docs link to.",
    ]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# GPU timing: warm up, capture, replay.
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Timing:
    method: str  # "graph": CUDA-graph replay; "loop": launched from Python (capture failed)
    calls_per_replay: int
    per_call_us: list[float]
    note: str = ""  # why the graph was not used


def _launch(fn, arg_sets, calls: int) -> None:
    """`calls` calls of `fn`, cycling through the input sets."""
    for i in range(calls):
        fn(*arg_sets[i % len(arg_sets)])


def _warm_up(fn, arg_sets) -> None:
    """Run a few calls on a side stream before capture, as torch's CUDA-graph docs prescribe:
    first-call work (compiles, module loads, workspace allocations) must not land in a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _launch(fn, arg_sets, WARMUP_CALLS)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _capture(fn, arg_sets, calls: int):
    """(a CUDA graph of `calls` calls, "") or (None, why capture failed)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):  # captures on torch's own side stream
            _launch(fn, arg_sets, calls)
    except Exception as error:  # e.g. a launch path that is not capture-safe
        torch.cuda.synchronize()  # raises if the failed capture broke the context: not recoverable
        return None, _error_text(error)
    return graph, ""


def _replayer(fn, arg_sets, calls: int, why_not_graph: str = ""):
    """(a zero-argument replay of `calls` calls, why it is a launch loop: "" for a graph)."""
    if not why_not_graph:
        graph, why_not_graph = _capture(fn, arg_sets, calls)
        if graph is not None:
            return graph.replay, ""
    return functools.partial(_launch, fn, arg_sets, calls), why_not_graph


def _time_replays(replay, count: int) -> list[float]:
    """Microseconds of GPU time of each of `count` back-to-back replays (CUDA events)."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    for start, end in events:
        start.record()
        replay()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * US_PER_MS for start, end in events]


def measure(fn, arg_sets, trace_path=None) -> Timing:
    """Per-call times of `fn` over the rotating `arg_sets` (see the module docstring)."""
    _warm_up(fn, arg_sets)
    sets = len(arg_sets)
    replay, why_loop = _replayer(fn, arg_sets, sets)  # one pass over the sets: an estimate
    call_us = statistics.median(_time_replays(replay, ESTIMATE_REPLAYS)) / sets
    calls = calls_per_replay(sets, call_us)
    if calls != sets:
        del replay  # free the estimate's graph before capturing the longer one
        replay, why_loop = _replayer(fn, arg_sets, calls, why_loop)
    _time_replays(replay, WARMUP_REPLAYS)
    per_replay_us = _time_replays(replay, TIMED_REPLAYS)
    if trace_path is not None:
        write_trace(replay, trace_path)
    return Timing("loop" if why_loop else "graph", calls, [us / calls for us in per_replay_us], why_loop)


def write_trace(replay, path) -> None:
    """A chrome trace (chrome://tracing, ui.perfetto.dev) of one replay."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    prof.export_chrome_trace(str(path))


def _copy(dst, src) -> None:
    dst.copy_(src)


def copy_bandwidth_gb_per_s() -> float:
    """GB/s of a COPY_BYTES device-to-device copy (bytes read plus written), timed like a kernel."""
    src = torch.ones(COPY_BYTES, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    timing = measure(_copy, [(dst, src)])
    median_us = summarize(timing.per_call_us)["median_us"]
    return 2 * COPY_BYTES / (median_us * 1e-6) / BYTES_PER_GB


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES


def storage_bytes(inputs: dict) -> int:
    """Device memory one input set holds (views into one fused qkv tensor count it once)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in inputs.values() if isinstance(t, torch.Tensor)}  # fmt: skip
    return sum(storages.values())


# --------------------------------------------------------------------------------------------
# The GPU benchmark.
# --------------------------------------------------------------------------------------------
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


def bench_shape(op, contract, shape, dtype, impls, copy_gb_per_s, progress, trace_dir=None) -> list[dict]:
    """Check, then time, every implementation in `impls` on one shape; one row each."""
    case = prepare_shape(op, contract, shape, dtype)
    rows = []
    for impl in impls:
        progress.begin(f"{op} {case.base_row['label']} {impl.name}")
        trace = None if trace_dir is None else Path(trace_dir) / f"trace_{op}_{dtype_name(dtype)}_{impl.name}.json"
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
        row.update(agrees=False, error=_error_text(error))
        progress.write(f"!! {where} FAILED: {row['error']}")
        return row
    row.update(summarize(timing.per_call_us), method=timing.method, calls_per_replay=timing.calls_per_replay)
    if timing.note:
        row["note"] = f"not capturable, timed as a launch loop: {timing.note}"
    row["gb_per_s"] = row["bytes_moved"] / (row["median_us"] * 1e-6) / BYTES_PER_GB
    row["pct_of_copy"] = 100 * row["gb_per_s"] / copy_gb_per_s
    return row


def add_speedups(rows) -> None:
    """x vs eager / x vs compile: the baseline's median over this row's (> 1: faster)."""
    medians = {row["impl"]: row["median_us"] for row in rows if row["median_us"]}
    for row in rows:
        if not row["median_us"]:
            continue
        for column, baseline in (("x_vs_eager", EAGER), ("x_vs_compile", COMPILED)):
            if baseline in medians:
                row[column] = medians[baseline] / row["median_us"]


def run(ops=None, dtype=DEFAULT_DTYPE, shapes="full", out="bench_out", *, profile=False,
        results_dir="docs/results", write_results=True, command=None) -> list[dict]:  # fmt: skip
    """Benchmark every registered implementation on the GPU; returns the result rows (dicts with
    the keys of ROW_FIELDS) and writes them, tables and plots to `out` (and, with
    `write_results`, the docs pages to `results_dir`)."""
    if not torch.cuda.is_available():
        raise RuntimeError("bench.run needs a CUDA GPU; on a CPU, bench.tour() checks the implementations")
    dtype = resolve_dtype(dtype)
    ops = [op for op in resolve_ops(ops) if op not in registry.DISTRIBUTED_OPS]  # collectives: cookbook.bench_tp
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    plan = _plan(ops, shapes)
    copy_gb_per_s = copy_bandwidth_gb_per_s()
    print(f"device-to-device copy ({COPY_BYTES // MIB} MiB, graph replay): {copy_gb_per_s / GB_PER_TB:.2f} TB/s")
    progress = Progress(sum(len(shape_list) * len(impls) for _, _, shape_list, impls in plan))
    rows = []
    for op, contract, shape_list, impls in plan:
        profiled = _largest_shape(contract, shape_list, dtype) if profile else None
        for shape in shape_list:
            trace_dir = out if shape == profiled else None
            rows += bench_shape(op, contract, shape, dtype, impls, copy_gb_per_s, progress, trace_dir)
            torch.cuda.empty_cache()  # the rotating sets of this shape are garbage now
    progress.close()
    meta = metadata(command or f"cookbook.bench.run(ops={ops}, dtype={dtype_name(dtype)}, shapes={shapes!r})",
                    copy_gb_per_s, dtype)
    write_outputs(rows, meta, out, Path(results_dir) if write_results else None)
    return rows


def _plan(ops, shapes) -> list[tuple]:
    """[(op, contract, shapes, runnable implementations)]; prints what will not run, and why."""
    plan = []
    for op in ops:
        contract = registry.contract(op)
        runnable, skipped = split_available(op, DEVICE)
        runnable, broken = _build_cuda_kernels(op, runnable)
        for impl, reason in skipped + broken:
            print(f"{op}: not benchmarked: {impl.name} ({reason})")
        plan.append((op, contract, select_shapes(contract.BENCH_SHAPES, shapes), runnable))
    return plan


def _build_cuda_kernels(op, impls) -> tuple[list, list]:
    """Build the op's CUDA C extension once, before any timing (minutes on first use): a build
    that fails is reported once, not once per shape and version. (runnable, [(impl, why not)])."""
    cuda_impls = [impl for impl in impls if impl.level == "cuda"]
    if not cuda_impls:
        return impls, []
    from cookbook import cuda

    print(f"{op}: building (or loading the cached) CUDA C kernels ...", flush=True)
    try:
        cuda.load(op)
    except Exception as error:
        print(f"!! {op}: the CUDA C build failed:\n{error}", file=sys.stderr, flush=True)
        reason = f"the CUDA C build failed: {_error_text(error)}"
        return [impl for impl in impls if impl.level != "cuda"], [(impl, reason) for impl in cuda_impls]
    return impls, []


def _largest_shape(contract, shapes, dtype):
    """The shape that moves the most bytes (inputs built on the meta device: no memory)."""
    def bytes_of(shape):
        return call_by_name(contract.bytes_moved, checked(contract, contract.bench_case(shape, dtype, "meta")[0]))

    return max(shapes, key=bytes_of)


# --------------------------------------------------------------------------------------------
# Outputs: tables, files, plots, docs pages.
# --------------------------------------------------------------------------------------------
def git_commit() -> str:
    """Short HEAD commit, "-dirty" when tracked files changed; "unknown" outside a git checkout.
    COOKBOOK_COMMIT, when set, names it instead (a copy of the tree on a remote GPU machine)."""
    if os.environ.get("COOKBOOK_COMMIT"):
        return os.environ["COOKBOOK_COMMIT"]

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        # A copy of the tree without .git (a remote GPU machine): the caller may name the commit.
        return os.environ.get("COOKBOOK_COMMIT", "unknown")
    return head + ("-dirty" if dirty else "")


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def metadata(command: str, copy_gb_per_s: float, dtype) -> dict:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {
        "gpu": props.name,
        "gpu_slug": gpu_slug(props.name),
        "compute_capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "l2_bytes": l2_bytes(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "numba_cuda": _installed_version("numba-cuda"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "command": command,
        "dtype": dtype_name(dtype),
        "copy_bytes": COPY_BYTES,
        "copy_tb_per_s": copy_gb_per_s / GB_PER_TB,
        "timing": f"median and p{LOW_PERCENTILE}-p{HIGH_PERCENTILE} of {TIMED_REPLAYS} CUDA-graph replays "
        f"(after {WARMUP_REPLAYS} warm-up replays), per call = replay / calls per replay; rotating input "
        f"sets moving >= {L2_FLUSH_FACTOR}x L2 per pass (at most {MAX_INPUT_SETS})",
    }


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _agreement_cell(row) -> str:
    """Short: the full agreement report and error are in results.json and printed when they occur."""
    if row["error"]:
        error = row["error"]
        return "ERROR: " + (error if len(error) <= MAX_CELL_CHARS else error[: MAX_CELL_CHARS - 3] + "...")
    if not row["agrees"]:
        return f"FAIL (max {row['max_ulp']:.3g} ulp), not timed"
    return f"ok ({row['max_ulp']:.2g} ulp)"


def bench_table(rows) -> str:
    headers = ["shape", "impl", "median us", "p20-p80 us", "GB/s", "% of copy", "x vs eager",
               "x vs compile", "timed by", "agreement"]  # fmt: skip
    body = []
    for r in rows:
        if r["median_us"] is None:
            timing = ["-"] * 7
        else:
            timing = [f"{r['median_us']:.2f}", f"{r['p20_us']:.2f}-{r['p80_us']:.2f}", f"{r['gb_per_s']:.0f}",
                      f"{r['pct_of_copy']:.0f} %", _x(r["x_vs_eager"]), _x(r["x_vs_compile"]), r["method"]]  # fmt: skip
        body.append([r["label"], r["impl"], *timing, _agreement_cell(r)])
    return markdown_table(headers, body)


def write_outputs(rows, meta, out: Path, results_dir: Path | None) -> None:
    """Tables to the console; results.csv, results.json and plots to `out`; docs pages."""
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        writer.writeheader()
        writer.writerows(dict(row, shape="x".join(map(str, row["shape"]))) for row in rows)
    (out / "results.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1))
    for op in dict.fromkeys(row["op"] for row in rows):
        op_rows = [row for row in rows if row["op"] == op]
        print(f"\n{op} ({meta['dtype']}) on {meta['gpu']}, copy {meta['copy_tb_per_s']:.2f} TB/s\n{bench_table(op_rows)}")
        plots = plot_op(op_rows, meta, out)
        if results_dir is not None:
            write_results_page(op, op_rows, meta, plots, results_dir)
    print(f"\nwrote {out / 'results.csv'}, {out / 'results.json'} and the plots in {out}/")


def results_stem(op: str, meta: dict) -> str:
    """`<op>_<gpu>` for the default dtype (the names the docs link to), `<op>_<gpu>_<dtype>` else."""
    stem = f"{op}_{meta['gpu_slug']}"
    return stem if meta["dtype"] == dtype_name(DEFAULT_DTYPE) else f"{stem}_{meta['dtype']}"


def _tokens(row) -> int:
    return row["shape"][0]  # BENCH_SHAPES entries start with the token count


@dataclasses.dataclass(frozen=True)
class RecordedSweep:
    """A sweep the benchmark recorded in the docs: the page `{op}_{gpu}.md` and its rows, from the
    JSON written beside it (`write_results_page`)."""

    page: Path
    rows: list
    metadata: dict

    @property
    def title(self) -> str:
        m = self.metadata
        return f"{m['gpu']}, sweep recorded {m['date'][:10]} at {m['commit']}"


def recorded_sweeps(op, results_dir, gpu_slug=None) -> list[RecordedSweep]:
    """The sweeps of `op` recorded in `results_dir`, one per GPU (only `gpu_slug`'s when given):
    what a notebook draws where it cannot time (no GPU) or timed too few points for a line (a
    quick run). Only `{op}_{gpu}` pages count: not another op's whose name extends this one's
    (`qk_norm_rope_h200` for `qk_norm`), nor the Nsight Compute and experiment pages."""
    found = []
    for path in sorted(Path(results_dir).glob(f"{op}_*.json")):
        slug = path.stem[len(op) + 1:]
        if not re.fullmatch(r"[a-z0-9]+", slug) or (gpu_slug is not None and slug != gpu_slug):
            continue
        data = json.loads(path.read_text())
        found.append(RecordedSweep(path.with_suffix(".md"), data["rows"], data["metadata"]))
    return found


def largest_family(rows) -> list[dict]:
    """The rows whose shapes differ only in the token count, from the biggest such family."""
    families = {}
    for row in rows:
        families.setdefault(tuple(row["shape"][1:]), []).append(row)
    return max(families.values(), key=lambda family: len({_tokens(r) for r in family}), default=[])


def line_style(index: int, impl: str) -> dict:
    """Matplotlib keywords for the index-th implementation of a plot: its own colour (PLOT_COLORS;
    past its 20, dashed lines), a marker for its level."""
    from matplotlib import colormaps

    colors = colormaps[PLOT_COLORS]
    return dict(color=colors(index % colors.N), linestyle="-" if index < colors.N else "--",
                marker=LEVEL_MARKERS.get(impl.split("_")[0], "D"))


def draw_lines(ax, family, column: str, ylabel: str) -> None:
    """On `ax`, `column` of a shape family against tokens, one line per implementation (plot_op and
    the notebooks draw with it)."""
    for i, impl in enumerate(dict.fromkeys(row["impl"] for row in family)):
        points = sorted((_tokens(r), r[column]) for r in family if r["impl"] == impl)
        ax.plot(*zip(*points), label=impl, **line_style(i, impl))
    if column == "pct_of_copy":
        ax.axhline(100, color="gray", linestyle="--", linewidth=1, label="device copy")
    else:
        ax.set_yscale("log")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)


def plot_op(rows, meta, out: Path) -> dict[str, Path]:
    """Latency and %-of-copy against tokens, one line per implementation: {plot name: png}."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print("matplotlib is not installed: no plots")
        return {}
    family = largest_family([row for row in rows if row["median_us"] is not None])
    if not family:
        return {}
    op, shape_tail = family[0]["op"], ", ".join(map(str, family[0]["shape"][1:]))
    paths = {}
    for plot, (column, ylabel) in PLOTS.items():
        fig = Figure(figsize=PLOT_SIZE_INCHES)
        FigureCanvasAgg(fig)  # render with Agg, whatever backend a notebook chose
        ax = fig.subplots()
        draw_lines(ax, family, column, ylabel)
        ax.set_title(f"{op}, shape (tokens, {shape_tail}), {meta['dtype']}, {meta['gpu']}", fontsize="medium")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the lines
        paths[plot] = out / f"{op}_{meta['dtype']}_{plot}.png"
        fig.savefig(paths[plot], dpi=PLOT_DPI, bbox_inches="tight")
    return paths


def write_results_page(op, rows, meta, plots: dict, results_dir: Path) -> None:
    """docs/results/<stem>.md (header and table), <stem>_<plot>.png and <stem>.json."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stem = results_stem(op, meta)
    images = []
    for plot, path in plots.items():
        target = results_dir / f"{stem}_{plot}.png"
        shutil.copyfile(path, target)
        images.append(f"![{op} {plot}]({target.name})")
    page = [
        f"# {op} on {meta['gpu']} ({meta['dtype']})",
        "",
        "Written by the benchmark: do not edit by hand, run the command again.",
        "",
        f"- GPU: {meta['gpu']} (sm {meta['compute_capability']}, {meta['sm_count']} SMs, "
        f"L2 {meta['l2_bytes'] // MIB} MiB); torch {meta['torch']}, CUDA {meta['cuda']}",
        f"- date: {meta['date']}; commit: {meta['commit']}",
        f"- command: `{meta['command']}`",
        f"- device-to-device copy ({COPY_BYTES // MIB} MiB, bytes read + written): {meta['copy_tb_per_s']:.2f} TB/s",
        f"- timing: {meta['timing']}",
        "",
        bench_table(rows),
        "",
        *images,
        "",
    ]
    (results_dir / f"{stem}.md").write_text("\n".join(page))
    (results_dir / f"{stem}.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1))
    print(f"wrote {results_dir / (stem + '.md')}")
