"""The main job: ``python -m cookbook [bench|tour|explain] [options]`` (also ``fused-norm-cookbook``).

``bench`` (the default): on a CUDA GPU, check and time every registered implementation of every
op side by side, and write tables, plots and the docs' results pages (see `cookbook.bench`). On a
machine without a GPU it runs the tour instead and says what a GPU run would add.

``tour``: the CPU tour: the PyTorch reference and the Numba kernels (under Numba's CUDA simulator)
on tiny shapes, both roundings, each checked against the contract. Exit status 0 when every
implementation agrees, 1 otherwise.

``explain``: which kernel, with which template arguments, grid and block, a call runs, and each
choice of the tuned kernel's policy with the numbers that decided it (`cookbook.explain`):
``python -m cookbook explain qk_norm --shape 8192,8,1,128 --dtype bfloat16 --gpu h100``.

Numba reads NUMBA_ENABLE_CUDASIM once, when it is first imported, so this module imports neither
Numba nor the kernels: the simulator is switched on before anything else can import them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys

COMMANDS = ("bench", "tour", "explain")
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
    explain = commands.add_parser("explain", help="which kernel a call runs, and why (the tuned kernel's policy)")
    explain.add_argument("op", help="the op (qk_norm)")
    explain.add_argument("--shape", required=True, help="the call's sizes, comma-separated: qk_norm T,HQ,HK,D")
    explain.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    explain.add_argument("--weight-dtype", choices=("float32", "float16", "bfloat16"),
                         help="the weights' dtype (default: the activations')")
    explain.add_argument("--rounding", default="fused", choices=("fused", "hf"))
    explain.add_argument("--layout", default="fused_qkv", choices=("fused_qkv", "separate"),
                         help="q and k as views of one fused qkv tensor (the benchmark's), or tensors of their own")
    where = explain.add_mutually_exclusive_group()
    where.add_argument("--gpu", choices=("h100", "h200"),
                       help="answer for this GPU from the policy compiled for the host (default on a machine without a GPU: h100)")
    where.add_argument("--sms", type=int, help="answer for a compute capability 9.0 GPU with this many SMs")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, DEFAULT_COMMAND)
    cli = parser()
    args = cli.parse_args(argv)
    if args.command == "explain":
        return explain_main(cli, args)

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


def explain_main(cli: argparse.ArgumentParser, args) -> int:
    import torch

    from cookbook import explainer

    try:
        shape = tuple(int(n) for n in args.shape.split(","))
    except ValueError:
        cli.error(f"--shape: expected comma-separated integers (qk_norm: T,HQ,HK,D), got {args.shape!r}")
    try:
        answer = explainer.explain(args.op, shape=shape, dtype=getattr(torch, args.dtype), layout=args.layout,
                                   weight_dtype=getattr(torch, args.weight_dtype) if args.weight_dtype else None,
                                   gpu=args.gpu, sms=args.sms, rounding=args.rounding)
    except (ValueError, TypeError) as error:
        cli.error(str(error))
    except RuntimeError as error:
        print(f"explain: {error}", file=sys.stderr)
        return 1
    print(answer)
    return 0


def exit_status(rows) -> int:
    """0 when every implementation agrees, else 1, with each failure named on stderr."""
    failed = [row for row in rows if not row["agrees"]]
    for row in failed:
        print(f"!! {row['op']} {row['label']} {row['impl']}: {row.get('error') or row['agreement']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
