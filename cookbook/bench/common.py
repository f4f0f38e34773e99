"""What every part of the benchmark shares: the op arguments every call uses, units, dtypes,
and calling an implementation the registry's way, then checking what it wrote."""

from __future__ import annotations

import dataclasses
import inspect
import time
from pathlib import Path

import torch

from cookbook import registry
from cookbook.testing import Agreement, agreement

REPO_ROOT = Path(__file__).resolve().parents[2]
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
US_PER_MS = 1e3
BYTES_PER_GB = 1e9
GB_PER_TB = 1e3

MIB = 1 << 20
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULT_DTYPE = torch.bfloat16
TOUR_DTYPES = (torch.float32, torch.bfloat16)
ROUNDINGS = ("fused", "hf")
SHAPE_CHOICES = ("quick", "full")
DEFAULT_OUT = "bench_out"  # results.csv/json, plots, traces, and the results pages unless told where
PAGES_OF_RECORD = "docs/results"  # the pages the docs link to: written only when asked (--results-dir)


def resolve_results_dir(out, results_dir=None) -> Path:
    """Where the results pages go: `results_dir` when given (``docs/results`` for the pages of
    record), else ``<out>/pages``, so a first run never replaces the checkout's committed pages."""
    return Path(results_dir) if results_dir is not None else Path(out) / "pages"


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


def error_text(error: BaseException) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {first_line}"
