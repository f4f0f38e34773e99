"""What the notebooks share: setup, agreement, timing, recorded sweeps and short source excerpts.

Every walkthrough in `notebooks/` does the same chores; here each is one call, so a notebook's
cells read as what they teach:

* `setup`: Numba's CUDA simulator switched on where there is no GPU (before anything imports
  Numba: it reads ``NUMBA_ENABLE_CUDASIM`` once, at import), the checkout, the versions;
* `agreement_table`: every implementation of an op run on the same inputs and checked against
  the contract, as one table;
* `measure_or_recall`: implementations timed at a few shapes by the benchmark's own machinery
  on a GPU, or else the numbers the benchmark recorded in ``docs/results/``; `effect` (one
  implementation against another), `timing_table`, `plot_rows` and `show_sweep` present them;
* `register_table`: registers and spills per kernel from ptxas (nvcc, no GPU);
* `excerpt`, `show_kernel`, `diff_rungs`: a short piece of a source file, never a whole file;
  `diff_rungs` is the ladder's teaching device: rung n is rung n-1 plus what its lead says;
* `results_link`: where a results page is, instead of its text.

Functions that print return None (a notebook cell would echo a returned value); the text they
print comes from functions the tests call. Importing this module imports neither Numba,
matplotlib nor a CUDA extension.
"""

from __future__ import annotations

import difflib
import importlib.metadata
import os
import platform
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cookbook import bench, registry
from cookbook.testing import Agreement, agreement

RESULTS_DIR = Path("docs") / "results"  # where the benchmark records its sweeps
NOTEBOOK_DIR = Path("notebooks")  # where the notebooks run: links are relative to it
MAX_LINES = 60  # the most lines of a source file one call prints (a notebook cell's budget)
DIFF_PAGE_LINES = 54  # the most lines of a diff one call prints: room for a lead, a note, an effect
DIFF_CONTEXT = 1  # unchanged lines around each change in `diff_rungs`
EPS = bench.EPS
AGREEMENT_SEED = 1

# sm_90 (H100, H200): what bounds the warps an SM holds by registers alone.
REGISTERS_PER_SM = 65536
MAX_WARPS_PER_SM = 64
REGISTER_ALLOC_UNIT = 256  # registers are allocated per warp in units of this many
WARP_SIZE = 32

# The cases `agreement_table` checks by default: both dtypes the notebooks teach, both rounding
# orders, and Gemma's (1 + w) weights.
CASES = (
    dict(dtype=torch.float32, rounding="fused"),
    dict(dtype=torch.float32, rounding="hf"),
    dict(dtype=torch.bfloat16, rounding="fused"),
    dict(dtype=torch.bfloat16, rounding="hf"),
    dict(dtype=torch.bfloat16, rounding="fused", weight_offset=1.0),
    dict(dtype=torch.bfloat16, rounding="hf", weight_offset=1.0),
)
CHECKED_LEVELS = ("reference", "numba", "cuda", "tuned")  # peers are timed, not checked here
_CASE_KEYS = ("dtype", "rounding", "weight_offset", "label")  # the rest go to make_inputs
_SHORT_DTYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ---- setup -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Session:
    """Where a notebook runs: the checkout, the device its tensors go to, the simulator."""

    root: Path
    device: torch.device
    simulator: bool  # Numba kernels run under Numba's CUDA simulator

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"


def numba_imported() -> bool:
    """True once Numba is loaded: it read NUMBA_ENABLE_CUDASIM then, once."""
    from kernels_numba import numba_choice  # does not import Numba

    return numba_choice() is not None


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


# Warnings a learner can do nothing about: Numba's note that a tiny grid under-fills the GPU (the
# walkthroughs run tiny shapes on purpose), the profiler's note on its cycles (the dispatch checks
# profile one call), TorchScript's deprecation (torch.compile's internals), and the optional backends
# a peer package logs it could not import.
QUIET_WARNINGS = (r".*Grid size \d+ will likely result in GPU under-utilization.*",
                  r".*Host array used in CUDA kernel will incur copy overhead.*",
                  r".*Profiler clears events at the end of each cycle.*",
                  r".*torch\.jit\.script_method. is deprecated.*")
QUIET_LOGGERS = ("liger_kernel",)


def quiet() -> None:
    """Silence QUIET_WARNINGS and QUIET_LOGGERS' messages below errors."""
    import logging
    import warnings

    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)


def provenance(ops) -> str:
    """The line every notebook prints first: the commit it ran at, and the fingerprint of the
    sources of each op it shows (tests/test_freshness.py compares them with today's)."""
    import datetime

    from cookbook import sources

    prints = ", ".join(f"{op} {fp}" for op, fp in sources.fingerprints(ops).items())
    day = datetime.date.today().isoformat()
    return f"ran at commit {bench.git_commit()} on {day}; sources: {prints}"


def setup(*ops: str) -> Session:
    """The first call of every notebook. Without a GPU it sets ``NUMBA_ENABLE_CUDASIM=1`` (unless
    you chose otherwise) while Numba is not imported yet; then prints the commit and the
    fingerprints of the sources of `ops` (every op by default), the device, the versions and the
    checkout, and silences the warnings a learner can do nothing about."""
    quiet()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and "NUMBA_ENABLE_CUDASIM" not in os.environ:
        if numba_imported():
            print("!! Numba was imported before setup(): its simulator stays off, so the Numba cells fail "
                  "here. Restart the kernel and run this cell first.")
        else:
            os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
    from kernels_numba import SIMULATOR  # does not import Numba

    session = Session(bench.REPO_ROOT, torch.device("cuda" if on_gpu else "cpu"), SIMULATOR)
    device = torch.cuda.get_device_name() if on_gpu else "no CUDA GPU (CPU only)"
    numba = "under the CUDA simulator" if SIMULATOR else "on the GPU" if on_gpu else "off"
    from cookbook import nvcc_report

    print(provenance(ops or registry.ops()))
    print(f"device: {device}; Numba kernels: {numba}")
    print(f"python {platform.python_version()}, torch {torch.__version__}, numba {_version('numba')}, "
          f"numba-cuda {_version('numba-cuda')}; nvcc: {'yes' if nvcc_report.nvcc() else 'not on PATH'}")
    print(f"checkout: {os.path.relpath(session.root)} (the one whose cookbook/ is imported, from this directory)")
    return session


# ---- agreement ---------------------------------------------------------------------------------
def case_label(case: dict) -> str:
    """A short column title for an agreement case: ``bf16 hf w+1``."""
    if "label" in case:
        return case["label"]
    words = [_SHORT_DTYPE.get(case["dtype"], str(case["dtype"])), case["rounding"]]
    if case.get("weight_offset"):
        words.append(f"w+{case['weight_offset']:g}")
    words += [f"{key}={value}" for key, value in case.items() if key not in _CASE_KEYS]
    return " ".join(words)


def check(impl, op: str, shape, case: dict, device, seed: int = AGREEMENT_SEED) -> Agreement:
    """Run `impl` once on fresh inputs of `shape` (q and k as views of one fused qkv tensor, as an
    engine leaves them) and check every output it writes against the op's contract."""
    contract = registry.contract(op)
    dtype, rounding, weight_offset = case["dtype"], case["rounding"], case.get("weight_offset", 0.0)
    make = {key: value for key, value in case.items() if key not in _CASE_KEYS}
    inputs = contract.make_inputs(*shape, dtype=dtype, device=device, seed=seed, fused_qkv=True, **make)
    untouched = {name: t.clone() if isinstance(t, torch.Tensor) else t for name, t in inputs.items()}
    want = contract.expected(untouched, EPS, weight_offset, rounding)
    args = contract.check_inputs(**inputs, eps=EPS, weight_offset=weight_offset, rounding=rounding)
    impl.fn(*bench.positional(args))
    results = [agreement(f"{impl.name}:{name}", inputs[name], exact, hf, rounding, contract.TOLERANCES[inputs[name].dtype])
               for name, (exact, hf) in want.items()]  # fmt: skip
    failed = [r.message for r in results if not r.ok]
    return Agreement(not failed, "; ".join(failed) or "ok", max(r.max_ulp for r in results))


@dataclass
class AgreementReport:
    """What `check_all` found: per implementation and case, the worst agreement over the shapes."""

    cases: list
    results: dict = field(default_factory=dict)  # impl name -> {case label: (ok, max ulp, message)}
    levels: dict = field(default_factory=dict)  # impl name -> level
    skipped: dict = field(default_factory=dict)  # reason -> [impl names]

    @property
    def failures(self) -> list[str]:
        return [f"{name}, {label}: {message}" for name, by_case in self.results.items()
                for label, (ok, _, message) in by_case.items() if not ok]  # fmt: skip


def check_all(op: str, shapes, cases=CASES, *, levels=CHECKED_LEVELS, device=None, impls=None) -> AgreementReport:
    """Every implementation of `op` that runs on `device` (default: the GPU if there is one),
    checked in every case on every shape (`impls` replaces the registry's list)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    report = AgreementReport([case_label(case) for case in cases])
    for impl in impls if impls is not None else registry.implementations(op, levels):
        reason = impl.unavailable(device)
        if reason:
            report.skipped.setdefault(reason, []).append(impl.name)
            continue
        report.levels[impl.name] = impl.level
        by_case = report.results.setdefault(impl.name, {})
        for case, label in zip(cases, report.cases):
            worst = (True, 0.0, "ok")
            for shape in shapes:
                try:
                    verdict = check(impl, op, shape, case, device)
                except Exception as error:  # a failure to run is reported in its cell, not raised
                    verdict = Agreement(False, f"{shape}: {bench.error_text(error)}", float("inf"))
                if not verdict.ok or verdict.max_ulp > worst[1]:
                    worst = (verdict.ok, verdict.max_ulp, verdict.message)
                if not verdict.ok:
                    break
            by_case[label] = worst
    return report


def agreement_text(report: AgreementReport) -> str:
    """The table of `check_all`: the worst error in ulps per implementation and case."""
    headers = ["implementation", "level", *report.cases]
    body = [[name, report.levels[name]] + [f"{ulp:.2g}" if ok else "FAIL" for ok, ulp, _ in by_case.values()]
            for name, by_case in report.results.items()]  # fmt: skip
    lines = [bench.markdown_table(headers, body), ""]
    lines += [f"FAIL {failure}" for failure in report.failures]
    for reason, names in report.skipped.items():
        lines.append(f"not run here: {', '.join(names)} ({reason})")
    runs = len(report.results) * len(report.cases)
    lines.append(f"{runs - len(report.failures)} of {runs} (implementation, case) pairs agree with the contract"
                 + (": FAILURES above" if report.failures else "."))
    return "\n".join(lines)


def agreement_table(op: str, shapes, cases=CASES, *, levels=CHECKED_LEVELS, device=None) -> None:
    """Print the agreement of every implementation of `op` that runs here (see `check_all`):
    max error in ulps of the output dtype, over `shapes`, per case."""
    print(f"{op}: worst error in ulps over {len(shapes)} shape(s) {', '.join(map(str, shapes))}\n")
    print(agreement_text(check_all(op, shapes, cases, levels=levels, device=device)))


# ---- timing: measured on a GPU, or recalled from the recorded sweep --------------------------
@dataclass
class Measured:
    """Result rows of the benchmark (keys: `bench.ROW_FIELDS`) and where they come from."""

    op: str
    names: list  # the implementations asked for, in order
    shapes: list
    rows: list
    source: str  # "measured now on ..." or "recorded in docs/results/...md (...)"
    missing: str  # what an absent row means: "not timed here" or "not in the recorded sweep"

    def row(self, impl: str, shape):
        return next((r for r in self.rows if r["impl"] == impl and r["shape"] == list(shape)), None)


class _Quiet:
    """The benchmark's progress interface, printing only its warnings (a failed or disagreeing
    implementation): a notebook cell keeps its output short."""

    def begin(self, what):
        pass

    def end(self):
        pass

    def write(self, message):
        print(message, flush=True)

    def close(self):
        pass


_copy_gb_per_s: list = []  # the copy ceiling of this GPU, measured once per process


def copy_gb_per_s() -> float:
    """GB/s of the benchmark's device-to-device copy on this GPU (measured on first use)."""
    if not _copy_gb_per_s:
        _copy_gb_per_s.append(bench.copy_bandwidth_gb_per_s())
    return _copy_gb_per_s[0]


def build(op: str, impls) -> list:
    """Build the CUDA C extensions of `impls` at once, in parallel (the ladder layout: one per
    kernel file); returns the implementations whose build did not fail (failures are printed)."""
    extensions = [impl.extension for impl in impls if impl.extension is not None]
    if not extensions:
        return list(impls)
    from cookbook import cuda

    failed = {name for name, result in cuda.build(extensions).items() if isinstance(result, Exception)}
    for impl in impls:
        if impl.extension is not None and impl.extension.name in failed:
            print(f"!! {op} {impl.name}: its CUDA C build failed; not timed")
    return [impl for impl in impls if impl.extension is None or impl.extension.name not in failed]


def measure(op: str, names, shapes, dtype=bench.DEFAULT_DTYPE) -> list[dict]:
    """Time the implementations `names` of `op` at `shapes` on this GPU, as the benchmark does
    (`bench.bench_shape`: agreement first, then CUDA-graph replay over rotating input sets);
    one result row per (shape, implementation). Without a GPU: a note, and no rows."""
    if not torch.cuda.is_available():
        print("timing needs a CUDA GPU: nothing measured here (`recall` reads the recorded sweep)")
        return []
    contract = registry.contract(op)
    impls = []
    for name in names:
        impl = registry.get(op, name)
        reason = impl.unavailable(bench.DEVICE)
        if reason:
            print(f"{op} {name}: not timed ({reason})")
        else:
            impls.append(impl)
    impls = build(op, impls)
    ceiling = copy_gb_per_s()
    rows = []
    for shape in shapes:
        rows += bench.bench_shape(op, contract, tuple(shape), bench.resolve_dtype(dtype), impls, ceiling, _Quiet())
        torch.cuda.empty_cache()  # this shape's rotating input sets are garbage now
    return rows


def recorded_sweep(op: str, gpu: str | None = None):
    """The sweep of `op` the benchmark recorded in docs/results (`gpu`'s, e.g. "h200", when given;
    else the first one found), or None."""
    sweeps = bench.recorded_sweeps(op, bench.REPO_ROOT / RESULTS_DIR, gpu)
    return sweeps[0] if sweeps else None


def current_rows(op: str, rows) -> tuple[list, list]:
    """(the rows that measured implementations the registry lists today, the names left out).

    A recorded sweep names implementations as the registry did when it ran. Where it holds CUDA C
    names the registry no longer lists, the compiled kernels were renumbered since (a ladder
    rebuilt), so the names it shares with today's registry may be other kernels: all its CUDA C
    rows are left out until the benchmark records the sweep again."""
    known = {impl.name for impl in registry.implementations(op)}
    compiled = {r["impl"] for r in rows if r["level"] in registry.COMPILED_LEVELS}
    renumbered = bool(compiled - known)
    keep = [r for r in rows if r["impl"] in known and not (renumbered and r["level"] in registry.COMPILED_LEVELS)]
    kept = {r["impl"] for r in keep}
    return keep, sorted({r["impl"] for r in rows} - kept, key=_name_order)


LEFT_OUT = "recorded before the CUDA C kernels were renumbered, or no longer registered: see `current_rows`"


def names_text(names) -> str:
    """Names with runs of consecutive numbers shortened: ``cuda_v1..cuda_v14, numba_v2``."""
    runs = []
    for name in names:
        prefix, number = _name_order(name)
        if runs and runs[-1][0] == prefix and number == runs[-1][2] + 1 and re.search(r"\d$", name):
            runs[-1][2] = number
        else:
            runs.append([prefix, number, number, name])
    return ", ".join(run[3] if run[1] == run[2] else f"{run[3]}..{run[0]}{run[2]}" for run in runs)


def _name_order(name: str):
    number = re.search(r"(\d+)$", name)
    return (re.sub(r"\d+$", "", name), int(number.group(1)) if number else 0)


def _page(path: Path) -> str:
    return path.relative_to(bench.REPO_ROOT).as_posix() if path.is_relative_to(bench.REPO_ROOT) else str(path)


def recall(op: str, names=None, shapes=None, gpu=None, dtype=bench.DEFAULT_DTYPE) -> tuple[list, str]:
    """(the recorded sweep's rows of `names` at `shapes`, in `dtype`, or all of them; where they
    come from). Rows of implementations that were renumbered since are left out (`current_rows`)."""
    sweep = recorded_sweep(op, gpu)
    if sweep is None:
        return [], f"no sweep of {op} recorded in {RESULTS_DIR.as_posix()}/ (`python -m cookbook bench --ops {op}` on a GPU writes one)"
    rows, left_out = current_rows(op, sweep.rows)
    dtype_name = bench.dtype_name(bench.resolve_dtype(dtype))
    rows = [r for r in rows if r["dtype"] == dtype_name
            and (names is None or r["impl"] in names) and (shapes is None or r["shape"] in [list(s) for s in shapes])]  # fmt: skip
    source = f"recorded in {_page(sweep.page)} ({sweep.title})"
    if left_out:
        source += f"\n  left out: {names_text(left_out)} ({LEFT_OUT})"
    return rows, source


def measure_or_recall(op: str, names, shapes, dtype=bench.DEFAULT_DTYPE) -> Measured:
    """`measure` on a GPU, else `recall`: the rows of `names` at `shapes`, with their source."""
    shapes = [list(shape) for shape in shapes]
    if torch.cuda.is_available():
        rows = measure(op, names, shapes, dtype)
        source = f"measured now on {torch.cuda.get_device_name()} (copy {copy_gb_per_s() / bench.GB_PER_TB:.2f} TB/s)"
        measured = Measured(op, list(names), shapes, rows, source, "not timed here")
    else:
        rows, source = recall(op, names, shapes, dtype=dtype)
        measured = Measured(op, list(names), shapes, rows, source, "not in the recorded sweep")
    print(f"{op}: {measured.source}")
    return measured


def _label(measured: Measured, shape) -> str:
    row = next((r for r in measured.rows if r["shape"] == list(shape)), None)
    return row["label"] if row else "x".join(map(str, shape))


def _timed(row) -> str:
    return f"{row['median_us']:.2f} us ({row['pct_of_copy']:.0f} % of copy)"


def effect_text(measured: Measured, before: str, after: str) -> str:
    """Per shape: `before`'s time and `after`'s, and the speedup (> 1: `after` is faster)."""
    lines = []
    for shape in measured.shapes:
        old, new = measured.row(before, shape), measured.row(after, shape)
        missing = [name for name, row in ((before, old), (after, new)) if row is None]
        untimed = [name for name, row in ((before, old), (after, new)) if row is not None and row["median_us"] is None]
        if missing:
            text = f"{' and '.join(missing)}: {measured.missing}"
        elif untimed:
            text = "; ".join(f"{name} not timed: {row['error'] or row['agreement']}"
                             for name, row in ((before, old), (after, new)) if row["median_us"] is None)  # fmt: skip
        else:
            text = f"{before} {_timed(old)} -> {after} {_timed(new)}: {old['median_us'] / new['median_us']:.2f}x"
        lines.append(f"{_label(measured, shape)}: {text}")
    return "\n".join(lines)


def effect(measured: Measured, before: str, after: str) -> None:
    """Print what `after` changed against `before` at each measured shape."""
    print(effect_text(measured, before, after))


def timing_text(measured: Measured, names=None) -> str:
    """One line per implementation (`names`, default: those asked for), one column per shape:
    median time and % of the copy."""
    names = list(names or measured.names)
    headers = ["implementation"] + [_label(measured, shape) for shape in measured.shapes]
    body = []
    for name in names:
        cells = []
        for shape in measured.shapes:
            row = measured.row(name, shape)
            if row is None:
                cells.append("-")
            elif row["median_us"] is None:
                cells.append("FAILED" if row["error"] else "DISAGREES")
            else:
                cells.append(f"{row['median_us']:.2f} us, {row['pct_of_copy']:.0f} %")
        body.append([name, *cells])
    note = f"median time per call and % of the device-to-device copy's bandwidth; -: {measured.missing}"
    return f"{bench.markdown_table(headers, body)}\n({note})"


def timing_table(measured: Measured, names=None) -> None:
    """Print `timing_text`."""
    print(timing_text(measured, names))


def plot_rows(rows, title: str, names=None) -> None:
    """Latency and % of copy against tokens, one line per implementation (`names`, or every one),
    for the largest family of shapes that differ only in the token count (`bench.draw_lines`)."""
    timed = [r for r in rows if r["median_us"] is not None and (names is None or r["impl"] in names)]
    family = bench.largest_family(timed)
    if len({r["shape"][0] for r in family}) < 2:
        print("fewer than two token counts of one shape were timed: no plot")
        return
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14, 4.5))
    for ax, (column, label) in zip(axes, bench.PLOTS.values()):
        bench.draw_lines(ax, family, column, label)  # a colour per implementation, a marker per level
    axes[1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    tail = ", ".join(map(str, family[0]["shape"][1:]))
    fig.suptitle(f"{family[0]['op']}, shape (tokens, {tail}): {title}")
    fig.tight_layout()


def show_sweep(op: str, names=None, gpu=None) -> None:
    """The recorded sweep of `op`: a link to its page and its plots (today's implementations)."""
    sweep = recorded_sweep(op, gpu)
    if sweep is None:
        print(f"no sweep of {op} recorded in {RESULTS_DIR.as_posix()}/ yet: `python -m cookbook bench --ops {op}` "
              "on a GPU writes one")
        return
    results_link(sweep.page)
    rows, left_out = current_rows(op, sweep.rows)
    if left_out:
        print(f"left out of the plot: {names_text(left_out)} ({LEFT_OUT})")
    plot_rows([r for r in rows if r["dtype"] == sweep.metadata["dtype"]], sweep.title, names)


def copy_ceiling(op: str) -> tuple[float | None, str]:
    """(TB/s of a device-to-device copy, where the figure comes from): measured now on this GPU,
    else the one recorded with the op's sweep; (None, why) if neither exists."""
    if torch.cuda.is_available():
        return copy_gb_per_s() / bench.GB_PER_TB, f"measured now on {torch.cuda.get_device_name()}"
    sweep = recorded_sweep(op)
    if sweep is None:
        return None, f"no GPU here and no sweep of {op} recorded in {RESULTS_DIR.as_posix()}/"
    return sweep.metadata["copy_tb_per_s"], f"recorded with {_page(sweep.page)} ({sweep.title})"


# ---- registers ---------------------------------------------------------------------------------
def warps_allowed(registers: int) -> int:
    """Warps per SM that `registers` per thread allow on sm_90 (registers only: block size and
    shared memory may allow fewer)."""
    per_warp = -(-registers * WARP_SIZE // REGISTER_ALLOC_UNIT) * REGISTER_ALLOC_UNIT
    return min(MAX_WARPS_PER_SM, REGISTERS_PER_SM // per_warp)


def _mangled_namespace(namespace: str) -> str:
    """`cookbook::qk_norm::v3` as it opens a mangled name: ``N8cookbook7qk_norm2v3``."""
    return "N" + "".join(f"{len(part)}{part}" for part in namespace.split("::"))


def short_kernel_name(name: str) -> str:
    """A demangled kernel without its return type, parameters and `cookbook::` qualifiers:
    ``qk_norm_v3_kernel<__nv_bfloat16, (Rounding)0, 128>`` (a mangled name is left as it is)."""
    if not name.startswith("void "):
        return name  # no demangler on this machine
    name = name.removeprefix("void ")
    name = name.split(">(")[0] + ">" if ">(" in name else name.split("(")[0]
    return re.sub(r"\bcookbook::(?:\w+::)*", "", name)


def _report_cached(ext) -> bool:
    """Whether nvcc_report already holds ptxas's report of this extension's compile (the tests
    compile every extension first, so in CI it does)."""
    from cookbook import nvcc_report

    return nvcc_report.report_is_cached(ext.name)


def register_rows(op: str, names, keep, compile_names=None) -> tuple[list, list]:
    """([(implementation, kernel, registers, spill bytes, warps/SM allowed)], [names skipped]) for
    the kernels of each extension in `names` (its own namespace's, not a lower rung's it falls
    back to) that `keep(kernel)` selects. Names outside `compile_names` (when given) are listed
    only if their report is cached: an extension takes 10 s to minutes to compile on a CPU."""
    from concurrent.futures import ThreadPoolExecutor

    from cookbook import nvcc_report

    rows, skipped, compiled = [], [], {}
    for name in names:
        ext = registry.get(op, name).extension
        if ext is None:
            raise ValueError(f"{op} {name}: not in the ladder layout; nvcc_report.compile_header({op!r}) compiles it")
        if compile_names is not None and name not in compile_names and not _report_cached(ext):
            skipped.append(name)
            continue
        compiled[name] = ext
    # One nvcc per extension, all at once: each is one single-threaded unit
    with ThreadPoolExecutor(max_workers=max(1, min(len(compiled), os.cpu_count() or 1))) as pool:
        reports = pool.map(lambda ext: nvcc_report.compile_extension(ext.name), compiled.values())
    for (name, ext), kernels in zip(compiled.items(), reports):
        own = _mangled_namespace(ext.namespace)
        for kernel in kernels:
            if own in kernel.mangled and keep(kernel):
                rows.append((name, short_kernel_name(kernel.kernel), kernel.registers, kernel.spill_bytes,
                             warps_allowed(kernel.registers)))
    return rows, skipped


def register_table(op: str, names, keep, compile_names=None) -> None:
    """Print `register_rows` as a table (nvcc alone, no GPU; a polite note without nvcc)."""
    from cookbook import nvcc_report

    if nvcc_report.nvcc() is None:
        print("nvcc is not on PATH: no resource report here (CI and the GPU machines have it)")
        return
    rows, skipped = register_rows(op, names, keep, compile_names)
    headers = ["implementation", "kernel", "registers", "spill bytes", "warps/SM the registers allow"]
    print(f"ptxas -v, {nvcc_report.DEFAULT_ARCH}:\n")
    print(bench.markdown_table(headers, rows))
    if skipped:
        print(f"\nnot compiled here (no cached report; `python -m cookbook.nvcc_report {op}` compiles every "
              f"extension, minutes on a small CPU): {', '.join(skipped)}")


# ---- sources -----------------------------------------------------------------------------------
def _source_lines(path) -> tuple[str, list[str]]:
    path = Path(path)
    full = path if path.is_absolute() else bench.REPO_ROOT / path
    return _page(full), full.read_text().splitlines()


def _find(lines, marker, start: int, where: str) -> int:
    for i in range(start, len(lines)):
        if marker in lines[i]:
            return i
    raise ValueError(f"{where}: no line containing {marker!r} after line {start}")


def _cut(where: str, lines, first: int, stop: int, max_lines: int) -> str:
    """Lines [first, stop) of a file under a title, `max_lines` lines in all at most (the title and
    a note of what was cut included)."""
    room = max_lines - 1 if stop - first <= max_lines - 1 else max_lines - 2
    shown = lines[first:min(stop, first + room)]
    while shown and not shown[-1].strip():
        shown.pop()
    text = [f"{where}, lines {first + 1}-{first + len(shown)}:", *shown]
    if stop - first > room:
        text.append(f"... ({stop - first - room} more lines to line {stop})")
    return "\n".join(text)


def excerpt_text(path, start: str, end: str | None = None, *, occurrence: int = 1, max_lines: int = MAX_LINES) -> str:
    """Lines of `path` (relative to the checkout) from the `occurrence`-th line containing `start`
    (-1: the last; a header that lists its versions' leads before their sections repeats them) up
    to the next line containing `end` (not shown); without `end`, to the end of the file. Cut to
    `max_lines` lines."""
    where, lines = _source_lines(path)
    found = [i for i, line in enumerate(lines) if start in line]
    index = occurrence - 1 if occurrence > 0 else occurrence
    if not -len(found) <= index < len(found):
        raise ValueError(f"{where}: no line #{occurrence} containing {start!r} ({len(found)} such lines)")
    first = found[index]
    stop = _find(lines, end, first + 1, where) if end is not None else len(lines)
    return _cut(where, lines, first, stop, max_lines)


def excerpt(path, start: str, end: str | None = None, *, occurrence: int = 1, max_lines: int = MAX_LINES) -> None:
    """Print `excerpt_text`: a short piece of a source file, not the whole file."""
    print(excerpt_text(path, start, end, occurrence=occurrence, max_lines=max_lines))


def _code(line: str) -> str:
    return line.split("//")[0]


def kernel_text(op: str, name: str, kernel: str | None = None, *, max_lines: int = MAX_LINES) -> str:
    """The `__global__` function `kernel` (default: ``<op>_<stem>_kernel``, e.g. ``qk_norm_v3_kernel``,
    ``qk_norm_tuned_kernel``) of implementation `name`, from its template line to its closing brace."""
    impl = registry.get(op, name)
    path = Path("kernels_cuda") / (impl.kernel or f"{op}.cuh")
    stem = impl.extension.stem if impl.extension is not None else f"v{impl.version}"
    kernel = kernel or f"{op}_{stem}_kernel"
    where, lines = _source_lines(path)
    called = re.compile(rf"\b{re.escape(kernel)}\s*\(")
    start = next((i for i, line in enumerate(lines) if called.search(_code(line))
                  and "__global__" in lines[i] + (lines[i - 1] if i else "")), None)  # fmt: skip
    if start is None:
        raise ValueError(f"{where}: no __global__ function {kernel} (a version that changes only its launcher?)")
    if "__global__" not in lines[start]:
        start -= 1
    while start and lines[start - 1].strip() and not lines[start - 1].lstrip().startswith("//") \
            and not _code(lines[start - 1]).rstrip().endswith((";", "}", "{")):
        start -= 1  # the template line(s) above it
    depth, opened, stop = 0, False, len(lines)
    for i in range(start, len(lines)):
        depth += _code(lines[i]).count("{") - _code(lines[i]).count("}")
        opened = opened or "{" in _code(lines[i])
        if opened and depth == 0:
            stop = i + 1
            break
    return _cut(where, lines, start, stop, max_lines)


def show_kernel(op: str, name: str, kernel: str | None = None, *, max_lines: int = MAX_LINES) -> None:
    """Print `kernel_text`: one kernel function of an implementation, not its whole file."""
    print(kernel_text(op, name, kernel, max_lines=max_lines))


def rung_files(op: str, n: int) -> tuple[Path, Path]:
    """The kernel files of rungs n-1 and n of `op`'s ladder, relative to the checkout."""
    rungs = {impl.version: impl for impl in registry.implementations(op, ("cuda",)) if impl.kernel is not None}
    if n - 1 not in rungs or n not in rungs:
        raise ValueError(f"{op}: no rungs {n - 1} and {n} in the ladder layout (rungs: {sorted(rungs)})")
    return tuple(Path("kernels_cuda") / rungs[v].kernel for v in (n - 1, n))


def _is_comment(line: str) -> bool:
    return line.lstrip().startswith("//")


def rung_diff(op: str, n: int, context: int = DIFF_CONTEXT, code_only: bool = False) -> list[str]:
    """The unified diff of rung n-1's kernel file into rung n's, line by line; `code_only`: of
    their lines that are not whole-line comments (the lead and the prose that explains it)."""
    before, after = rung_files(op, n)
    a, b = (_source_lines(path)[1] for path in (before, after))
    if code_only:
        a, b = ([line for line in lines if not _is_comment(line)] for lines in (a, b))
    return list(difflib.unified_diff(a, b, before.as_posix(), after.as_posix(), n=context, lineterm=""))


CONTINUED = "@@ (the hunk above, continued) @@"


def diff_pages(diff: list[str], max_lines: int = DIFF_PAGE_LINES) -> list[list[str]]:
    """A diff cut into pages of at most `max_lines` lines, each repeating the two file lines: whole
    hunks where a hunk fits in a page; a longer one fills the page it starts on and goes on in the
    next under a CONTINUED line."""
    files, hunks = diff[:2], []
    if max_lines < len(files) + 2:
        raise ValueError(f"max_lines: expected at least {len(files) + 2} (the file lines, a marker, a line), got {max_lines}")
    for line in diff[2:]:
        if line.startswith("@@") or not hunks:
            hunks.append([])
        hunks[-1].append(line)
    pages, page = [], list(files)
    for hunk in hunks:
        if len(page) + len(hunk) > max_lines and len(hunk) <= max_lines - len(files):
            pages.append(page)  # the hunk fits on a page of its own: start one
            page = files + hunk
            continue
        rest = hunk
        while rest:
            room = max_lines - len(page)
            page += rest[:room]
            rest = rest[room:]
            if rest:
                pages.append(page)
                page = files + [CONTINUED]
    pages.append(page)
    return pages


def diff_rungs(op: str, n: int, part: int = 1, *, context: int = DIFF_CONTEXT, max_lines: int = DIFF_PAGE_LINES,
               code_only: bool = False) -> None:
    """Print the diff of rung n-1 into rung n (part `part` where it is longer than `max_lines`;
    `code_only`: without whole-line comments)."""
    pages = diff_pages(rung_diff(op, n, context, code_only), max_lines)
    if not 1 <= part <= len(pages):
        raise ValueError(f"part: expected 1 to {len(pages)}, got {part}")
    print("\n".join(pages[part - 1]))
    if part < len(pages):
        print(f"... part {part} of {len(pages)}: diff_rungs({op!r}, {n}, part={part + 1}) shows the rest")


# ---- results pages -----------------------------------------------------------------------------
def results_pages(op: str, kind: str = "") -> list[Path]:
    """The pages of `op` in docs/results (`<op>_<gpu>[_<kind>].md`, relative to the checkout),
    not those of an op whose name extends it (qk_norm_rope's for qk_norm). `kind`: the pages whose
    name has it as a word (``"ncu"``: ``qk_norm_h200_ncu_v12_v13.md`` too), else the sweeps
    (``<op>_<gpu>.md``)."""
    others = [other for other in registry.ops() if other != op and other.startswith(op + "_")]
    pages = []
    for path in sorted((bench.REPO_ROOT / RESULTS_DIR).glob(f"{op}_*.md")):
        if any(path.stem.startswith(other + "_") for other in others):
            continue
        tail = path.stem[len(op) + 1:]
        if (kind and re.search(rf"(^|_){re.escape(kind)}(_|$)", tail)) or (not kind and re.fullmatch(r"[a-z0-9]+", tail)):
            pages.append(path.relative_to(bench.REPO_ROOT))
    return pages


def link_text(page) -> str:
    """`page` (relative to the checkout) as a markdown link that works from notebooks/."""
    page = Path(_page(Path(page) if Path(page).is_absolute() else bench.REPO_ROOT / page))
    relative = Path(os.path.relpath(page, NOTEBOOK_DIR)).as_posix()
    return f"[{page.as_posix()}]({relative})"


def results_link(page) -> None:
    """Print where a results page is (a link relative to notebooks/), not the page itself."""
    page = Path(page)
    full = page if page.is_absolute() else bench.REPO_ROOT / page
    if not full.is_file():
        print(f"{_page(full)}: not recorded yet")
        return
    title = full.read_text().splitlines()[0].lstrip("# ").strip()
    print(f"{link_text(page)}: {title}")
