"""The main job: ``python -m cookbook [bench|tour] [options]`` (also ``fused-norm-cookbook``).

``bench`` (the default): on a CUDA GPU, check and time every registered implementation of every
op side by side, and write tables, plots and the docs' results pages (see `cookbook.bench`). On a
machine without a GPU it runs the tour instead and says what a GPU run would add.

``tour``: the CPU tour: the PyTorch reference and the Numba kernels (under Numba's CUDA simulator)
on tiny shapes, both roundings, each checked against the contract. Exit status 0 when every
implementation agrees, 1 otherwise.

Numba reads NUMBA_ENABLE_CUDASIM once, when it is first imported, so this module imports neither
Numba nor the kernels: the simulator is switched on before anything else can import them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

COMMANDS = ("bench", "tour")
DEFAULT_COMMAND = "bench"


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cookbook",
        description="Check and profile every implementation side by side on a GPU (bench, the default), "
        "or check them on a CPU under Numba's CUDA simulator (tour).",
    )
    commands = parser.add_subparsers(dest="command")
    bench = commands.add_parser("bench", help="check and time every implementation on the GPU (default)")
    bench.add_argument("--ops", nargs="+", metavar="OP", help="ops to run (default: every registered op)")
    bench.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    bench.add_argument("--shapes", default="full", choices=("quick", "full"),
                       help="quick: the first, middle and last benchmark shapes")
    bench.add_argument("--out", default="bench_out", help="directory for results.csv/json, plots, traces")
    bench.add_argument("--profile", action="store_true",
                       help="also write a torch.profiler chrome trace of each implementation at the largest shape")
    bench.add_argument("--results-dir", default="docs/results", help="where the docs' results pages go")
    bench.add_argument("--no-results", action="store_true", help="do not write the docs' results pages")
    bench.add_argument("--impls", nargs="+", metavar="NAME",
                       help="only these implementations: names, levels (tuned, peer, ...) or 'fastest'")
    bench.add_argument("--tag", help="name the results pages <op>_<gpu>_<tag> (a partial sweep beside the full one)")
    bench.add_argument("--nproc", type=int, default=None,
                       help="GPUs (ranks) for the collective op tp_qk_norm, run under torchrun (default: 2)")
    tour = commands.add_parser("tour", help="the CPU tour under Numba's CUDA simulator")
    tour.add_argument("--ops", nargs="+", metavar="OP", help="ops to run (default: every registered op)")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, DEFAULT_COMMAND)
    cli = parser()
    args = cli.parse_args(argv)

    import torch  # imports no Numba

    on_cpu = args.command == "tour" or not torch.cuda.is_available()
    if on_cpu:
        if args.command == "bench":
            print("No CUDA GPU is visible: running the CPU tour (Numba's CUDA simulator) instead.")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before anything imports Numba or kernels_numba
    from cookbook import bench, registry

    try:
        ops = bench.resolve_ops(args.ops)
    except ValueError as error:
        cli.error(str(error))  # exits with status 2
    collective = [op for op in ops if op in registry.DISTRIBUTED_OPS]
    ops = [op for op in ops if op not in registry.DISTRIBUTED_OPS]
    if on_cpu:
        status = exit_status(bench.tour(ops=ops)) if ops else 0
        if collective or not args.ops:  # the collective op's tour: two gloo ranks under torchrun
            from cookbook.bench import tp as bench_tp

            status = max(status, bench_tp.launch_tour())
        return status
    status = 0
    if collective:  # one process per GPU, under torchrun (cookbook.bench.tp)
        from cookbook.bench import tp as bench_tp

        forward = ["--dtype", args.dtype, "--shapes", args.shapes, "--out", args.out, "--results-dir", args.results_dir,
                   *(["--no-results"] if args.no_results else []),
                   "--command", shlex.join(["python", "-m", "cookbook", *argv])]
        status = bench_tp.launch(args.nproc, forward)
    if not ops:
        return status
    rows = bench.run(
        ops=ops,
        dtype=args.dtype,
        shapes=args.shapes,
        out=args.out,
        profile=args.profile,
        results_dir=args.results_dir,
        write_results=not args.no_results,
        command=shlex.join(["python", "-m", "cookbook", *argv]),
        impls=args.impls,
        tag=args.tag,
    )
    return max(exit_status(rows), status)


def exit_status(rows) -> int:
    """0 when every implementation agrees, else 1, with each failure named on stderr."""
    failed = [row for row in rows if not row["agrees"]]
    for row in failed:
        print(f"!! {row['op']} {row['label']} {row['impl']}: {row.get('error') or row['agreement']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
