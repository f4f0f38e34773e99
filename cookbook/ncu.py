"""Hardware counters of the CUDA C kernels, read by Nsight Compute (`ncu`), side by side.

    python -m cookbook.ncu --op cross_head_norm --shape 2          # on a GPU machine with ncu
    python -m cookbook.ncu --op qk_norm_rope --shape 4 --impls cuda_v3 cuda_v4 --out ncu_out

For one benchmark shape of an op (an index into its contract's ``BENCH_SHAPES``), every CUDA C
implementation is called once under ncu (the process re-launches itself as ncu's target; only
the calls between ``cudaProfilerStart`` and ``cudaProfilerStop`` are profiled, after a warm-up
call that builds and loads the kernels; one ncu process per implementation). For every kernel those calls launch it reports the
registers per thread, the theoretical occupancy the compiler's resources allow, the **achieved
occupancy** (the average share of the SM's warp slots that held a warp), DRAM throughput, the
share of cycles the schedulers issued an instruction, the duration under ncu, and the stall
reasons that dominate. Clocks are left alone (``--clock-control none``): durations are close to
the benchmark's, but the benchmark (graph replay, rotating inputs) is the timing of record.

Writes ``<out>/<op>_ncu.md`` and ``.csv`` and, with ``--results-dir``, the same table into the
docs' results folder as ``<op>_<gpu>_ncu[_<tag>].md`` with the GPU, date, commit and command, and
its rows as ``.json`` beside it (what tools/docs_versions.py reads: cross_head_norm's ladder table
takes each rung's achieved occupancy from ``--tag ladder``).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SECTIONS = ("LaunchStats", "Occupancy", "SpeedOfLight", "WarpStateStats", "MemoryWorkloadAnalysis")

# (column, a fragment of the section's title on the details page, metric name as printed there)
COLUMNS = [
    ("registers", "Launch Statistics", "Registers Per Thread"),
    ("block", "Launch Statistics", "Block Size"),
    ("grid", "Launch Statistics", "Grid Size"),
    ("theoretical occupancy %", "Occupancy", "Theoretical Occupancy"),
    ("achieved occupancy %", "Occupancy", "Achieved Occupancy"),
    ("DRAM throughput %", "Speed Of Light", "DRAM Throughput"),
    ("issue slots busy %", "", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("warp instructions", "", "smsp__inst_executed.sum"),
    ("cycles per issue", "Warp State", "Warp Cycles Per Issued Instruction"),
    ("duration us", "Speed Of Light", "Duration"),
    ("L2 hit rate %", "Memory Workload Analysis", "L2 Hit Rate"),
    ("L2 read hit rate %", "", "lts__t_sector_op_read_hit_rate.pct"),
]
# Why warps were not issuing: average warps stalled for each reason, per issued instruction.
STALL_REASONS = ("long_scoreboard", "lg_throttle", "mio_throttle", "short_scoreboard", "wait", "barrier",
                 "math_pipe_throttle", "not_selected", "no_instruction", "drain", "membar", "branch_resolving",
                 "dispatch_stall", "sleeping", "tex_throttle", "imc_miss", "misc", "selected")
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
EXTRA_METRICS = (["smsp__issue_active.avg.pct_of_peak_sustained_active", "smsp__inst_executed.sum"]
                 + [STALL_METRIC.format(r) for r in STALL_REASONS])
# Asked for only where this ncu knows them (`ncu --query-metrics`): an unknown name fails the run.
# The read hit rate leaves out the writes, which an in-place kernel's L2 always counts as hits
# (the line was just read), so it is the share of the loads' sectors that did not go to DRAM.
OPTIONAL_METRICS = ["lts__t_sector_op_read_hit_rate.pct"]


def metric_listing(ncu: str) -> str:
    """What `ncu --query-metrics` prints."""
    return subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True).stdout


def known_metrics(ncu: str, names: list[str]) -> list[str]:
    """The metrics of `names` that `ncu --query-metrics` lists (by base name, before the rollup)."""
    listed = {line.split()[0] for line in metric_listing(ncu).splitlines() if line.strip()}
    return [name for name in names if name.split(".")[0] in listed]


def _child(op: str, shape_index: int, impl_names: list[str]) -> None:
    """ncu's target: one warm-up call of each implementation, then one profiled call each."""
    import torch

    from cookbook import bench, registry

    contract = registry.contract(op)
    shape = contract.BENCH_SHAPES[shape_index]
    impls = [registry.get(op, name) for name in impl_names]
    inputs, _ = contract.bench_case(shape, bench.resolve_dtype("bfloat16"), "cuda")
    args = bench.checked(contract, inputs)
    for impl in impls:
        impl.fn(*bench.positional(args))  # build, load, first-launch costs: outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for impl in impls:
        impl.fn(*bench.positional(args))
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _to_float(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_details(csv_text: str) -> list[dict]:
    """ncu's ``--page details --csv`` output -> one dict per profiled kernel launch, in launch order."""
    start = csv_text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(csv_text[start:])))
    launches: dict[str, dict] = {}
    for row in rows:
        launch = launches.setdefault(row["ID"], {"kernel": row["Kernel Name"], "stalls": {}})
        section, name, unit, value = row["Section Name"], row["Metric Name"], row["Metric Unit"], row["Metric Value"]
        for column, want_section, want_name in COLUMNS:
            if name == want_name and want_section.lower() in section.lower():
                number = _to_float(value)
                if column == "duration us" and isinstance(number, float):
                    number = number / 1000.0 if unit.startswith("n") else number * 1000.0 if unit.startswith("m") else number
                launch.setdefault(column, number)
        for reason in STALL_REASONS:
            if name == STALL_METRIC.format(reason) and reason != "selected":
                launch["stalls"][reason] = _to_float(value)
    return [launches[key] for key in sorted(launches, key=int)]


def short_kernel_name(name: str) -> str:
    """``void cookbook::op::foo_kernel<...>(...)`` -> ``foo_kernel<...>``."""
    name = name.removeprefix("void ")
    name = name[:name.rfind("(")] if name.endswith(")") else name  # drop the parameter list
    plain = name[:name.find("<")] if "<" in name else name
    return name[plain.rfind("::") + 2:] if "::" in plain else name


def _cell(value) -> str:
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.2f}"
    return str(value)


def table(launches: list[dict], impl_of: list[str]) -> str:
    from cookbook.bench import markdown_table

    headers = ["impl", "kernel"] + [c for c, _, _ in COLUMNS] + ["top stalls (cycles per issue)"]
    body = []
    for impl, launch in zip(impl_of, launches):
        stalls = sorted(((v, k) for k, v in launch["stalls"].items() if isinstance(v, float)), reverse=True)[:3]
        body.append([impl, short_kernel_name(launch["kernel"])] + [_cell(launch.get(c, "-")) for c, _, _ in COLUMNS]
                    + [", ".join(f"{k} {v:.1f}" for v, k in stalls) or "-"])
    return markdown_table(headers, body)


def ncu_path() -> str | None:
    """Nsight Compute's command line, where it is on PATH."""
    return shutil.which("ncu")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cookbook.ncu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", required=True)
    parser.add_argument("--shape", type=int, default=-1, help="index into the contract's BENCH_SHAPES (default: last)")
    parser.add_argument("--impls", nargs="+", help="implementations (default: every CUDA C version)")
    parser.add_argument("--out", default="ncu_out")
    parser.add_argument("--results-dir", help="also write <op>_<gpu>_ncu[_<tag>].md and .json here (the docs' results folder)")
    parser.add_argument("--tag", help="name the results page <op>_<gpu>_ncu_<tag> (beside other Nsight Compute pages)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    from cookbook import registry

    if args.op not in registry.ops():
        parser.error(f"--op: expected one of {', '.join(registry.ops())}, got {args.op!r}")
    contract = registry.contract(args.op)
    count = len(contract.BENCH_SHAPES)
    if not -count <= args.shape < count:
        parser.error(f"--shape: {args.op} has {count} benchmark shapes (0..{count - 1}, or -{count}..-1 from the "
                     f"end), got {args.shape}")
    shape_index = args.shape % count
    names = args.impls or [impl.name for impl in registry.implementations(args.op, ("cuda",))]
    unknown = sorted(set(names) - {impl.name for impl in registry.implementations(args.op)})
    if unknown:
        parser.error(f"--impls: {args.op} has no implementation named {', '.join(unknown)}")
    if args.child:
        _child(args.op, shape_index, names)
        return 0

    ncu = ncu_path()
    if ncu is None:
        print("ncu (Nsight Compute) is not on PATH: nothing to profile", file=sys.stderr)
        return 2
    optional = known_metrics(ncu, OPTIONAL_METRICS)
    launches, impl_of, raw = [], [], []
    for name in names:  # one ncu process per implementation: each launch is then known to be its
        command = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "details"]
        for section in SECTIONS:
            command += ["--section", section]
        command += ["--metrics", ",".join(EXTRA_METRICS + optional)]
        command += [sys.executable, "-m", "cookbook.ncu", "--child", "--op", args.op, "--shape", str(shape_index),
                    "--impls", name]
        run = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ))
        if run.returncode != 0 or '"ID"' not in run.stdout:
            print(f"ncu failed on {name}:", run.stdout[-4000:], run.stderr[-4000:], sep="\n", file=sys.stderr)
            return run.returncode or 1
        found = parse_details(run.stdout)
        launches += found
        impl_of += [name] * len(found)
        raw.append(run.stdout[run.stdout.find('"ID"'):])

    import torch

    from cookbook import bench

    _, label = contract.bench_case(contract.BENCH_SHAPES[shape_index], bench.resolve_dtype("bfloat16"), "meta")
    gpu = torch.cuda.get_device_name()
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')
    command = f"python -m cookbook.ncu {' '.join(argv if argv is not None else sys.argv[1:])}"
    text = (f"# {args.op}: Nsight Compute counters on {gpu} (bfloat16, {label})\n\n"
            "Written by `python -m cookbook.ncu`: do not edit by hand, run the command again.\n\n"
            f"- GPU: {gpu}; torch {torch.__version__}, CUDA {torch.version.cuda}\n"
            f"- date: {date}; "
            f"commit: {bench.git_commit()}\n"
            f"- command: `{command}`\n"
            "- one call of each implementation, ncu sections " + ", ".join(SECTIONS) +
            ", clocks not locked; durations are ncu's (single cold call), the benchmark's graph replay is the "
            "timing of record\n\n" + table(launches, impl_of) + "\n")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.op}_ncu.md").write_text(text)
    (out / f"{args.op}_ncu.csv").write_text("\n".join(raw))
    if args.results_dir:
        page = Path(args.results_dir) / f"{args.op}_{bench.gpu_slug(gpu)}_ncu{'_' + args.tag if args.tag else ''}.md"
        page.write_text(text)
        from cookbook import sources

        meta = dict(gpu=gpu, date=date, commit=bench.git_commit(), shape=label, command=command,
                    sources={args.op: sources.fingerprint(args.op)})
        rows = [dict(impl=impl, kernel=short_kernel_name(launch["kernel"]),
                     **{column: launch.get(column) for column, _, _ in COLUMNS}, stalls=launch["stalls"])
                for impl, launch in zip(impl_of, launches)]
        page.with_suffix(".json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
