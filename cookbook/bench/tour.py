"""The CPU tour: every implementation a CPU can run (the PyTorch reference, the Numba kernels
under Numba's CUDA simulator) on the contract's tiny ``SIM_SHAPES``, float32 and bfloat16, both
roundings, each checked for agreement. Simulator timings mean nothing: every GPU thread runs as a
Python thread."""

from __future__ import annotations

import functools
import os

import torch

from cookbook import registry
from cookbook.bench.common import (ROUNDINGS, TOUR_DTYPES, TOUR_SEED, US_PER_MS, dtype_name, error_text,
                                   expected_outputs, resolve_ops, run_and_compare, split_available)
from cookbook.bench.tables import tour_table


def request_simulator() -> None:
    """On a machine without a GPU, ask for Numba's CUDA simulator if Numba has not read its
    configuration yet (it reads NUMBA_ENABLE_CUDASIM once, at import). On a GPU machine
    the process keeps real Numba kernels: `python -m cookbook tour` turns the simulator on for its
    own process."""
    from kernels_numba import numba_choice  # does not import Numba

    if numba_choice() is None and not torch.cuda.is_available():
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"


def tour(ops=None, shapes=None, dtypes=TOUR_DTYPES, roundings=ROUNDINGS, echo=print) -> list[dict]:
    """Run and check every CPU-runnable implementation; returns one row per call.

    `shapes` maps an op to its shapes (default: the contract's ``SIM_SHAPES``; each shape is the
    leading positional arguments of the contract's ``make_inputs``).
    """
    request_simulator()
    ops = [op for op in resolve_ops(ops) if op not in registry.DISTRIBUTED_OPS]  # collectives: cookbook.bench.tp
    rows, not_here = [], []
    for op in ops:
        contract = registry.contract(op)
        runnable, skipped = split_available(op, "cpu")
        cases = [(shape, dtype, rounding) for shape in (shapes or {}).get(op, contract.SIM_SHAPES)
                 for dtype in dtypes for rounding in roundings]
        echo(f"\n{op}: {', '.join(impl.name for impl in runnable)} on {len(cases)} cases "
             f"(tiny shapes x {len(dtypes)} dtypes x {len(roundings)} roundings) ...")
        op_rows = []
        for i, (shape, dtype, rounding) in enumerate(cases, 1):
            op_rows += _tour_case(op, contract, runnable, shape, dtype, rounding)
            echo(f"  [{i}/{len(cases)}] {op_rows[-1]['label']} {dtype_name(dtype)} {rounding}: "
                 f"{sum(row['agrees'] for row in op_rows[-len(runnable):])} of {len(runnable)} agree")
        echo(f"{op}: agreement on the CPU (wall times are the simulator's: they mean nothing)")
        echo(tour_table(op_rows))
        for row in op_rows:
            if not row["agrees"]:
                echo(f"  FAIL {row['label']} {row['dtype']} {row['rounding']}: {row['agreement']}")
        not_here += [impl.name for impl, _ in skipped if impl.package is None]  # peers: one line in gpu_would_add
        rows += op_rows
    failed = sum(not row["agrees"] for row in rows)
    echo(f"\n{len(rows) - failed} of {len(rows)} runs agree with the contract." + (" FAILURES above." if failed else ""))
    if not_here:
        echo(f"Not run here: {len(not_here)} implementations need a CUDA GPU (the CUDA C rungs and tuned "
             "kernels, torch.compile).")
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
            row.update(agreement=error_text(error))
        rows.append(row)
    return rows


def gpu_would_add(ops) -> str:
    """What `python -m cookbook bench` adds on a CUDA GPU, named from the registry."""
    lines = ["\nOn a CUDA GPU, `python -m cookbook bench` also:"]
    for op in ops:
        gpu_only = [impl.name for impl in registry.implementations(op, ("cuda", "tuned", "peer")) if impl.package is None]
        lines.append(f"  - runs {op}'s {', '.join(gpu_only)} and its Numba kernels on the real GPU;")
    packages = sorted({impl.package for op in ops for impl in registry.implementations(op, ("peer",)) if impl.package})
    if packages:
        lines.append(f"  - with the optional peers installed ({', '.join(packages)}: docs/peers.md), "
                     "sets them side by side;")
    lines += [
        "  - checks each implementation on every benchmark shape, then times it by CUDA-graph replay",
        "    over rotating input sets (median, p20-p80), in GB/s and % of a device-to-device copy",
        "    measured in the same run, with speedups over PyTorch eager and torch.compile;",
        "  - writes results.csv, results.json and latency / %-of-copy plots to bench_out/, and the",
        "    results pages <op>_<gpu>.md (with plots and JSON) to bench_out/pages/ (the pages of",
        "    record that the docs link to: --results-dir docs/results).",
    ]
    return "\n".join(lines)
