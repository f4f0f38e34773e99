"""The main job: ``python -m cookbook [bench|tour|explain] [options]`` (also ``fused-norm-cookbook``).

``bench`` (the default): on a CUDA GPU, check and time every registered implementation of every
op side by side, and write tables, plots and results pages to ``bench_out/`` (see
`cookbook.bench`; the pages of record that the docs link to with ``--results-dir docs/results``).
On a machine without a GPU it runs the tour instead (honouring ``--ops``, ``--dtype`` and
``--nproc``, refusing the GPU benchmark's other options by name) and says what a GPU run would add.

``tour``: the CPU tour: the PyTorch reference and the Numba kernels (under Numba's CUDA simulator)
on tiny shapes, both roundings, each checked against the contract.

Exit status: 0 when every implementation agrees, 1 otherwise; 2 for arguments this machine cannot
honour (and usage errors).

``explain``: which kernel, with which template arguments, grid and block, a call runs, and each
choice of the tuned kernel's policy with the numbers that decided it (`cookbook.explain`):
``python -m cookbook explain qk_norm --shape 8192,8,1,128 --dtype bfloat16 --gpu h100``;
``python -m cookbook explain tp_qk_norm --shape 512,6144,1024 --world 2 --gpu h100``.

Numba reads NUMBA_ENABLE_CUDASIM once, when it is first imported, so this module imports neither
Numba nor the kernels: the simulator is switched on before anything else can import them.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

COMMANDS = ("bench", "tour", "explain")
DEFAULT_COMMAND = "bench"
MODULE_COMMAND = "python -m cookbook"
CONSOLE_SCRIPT = "fused-norm-cookbook"  # pyproject.toml's [project.scripts]
DTYPES = ("float32", "float16", "bfloat16")
# bench's options that the CPU tour honours (its tp_qk_norm tour: --nproc gloo ranks); the others
# time or write on a GPU, and are refused by name where the tour runs instead.
TOUR_OPTIONS = ("ops", "dtype", "nproc")
GPU_OPTIONS = {"shapes": "--shapes", "out": "--out", "profile": "--profile", "results_dir": "--results-dir",
               "no_results": "--no-results", "impls": "--impls", "tag": "--tag"}


def program_name(argv0: str | None = None) -> str:
    """How this command was invoked, for its usage lines: the console script's name, else
    ``python -m cookbook``."""
    name = Path(sys.argv[0] if argv0 is None else argv0).name
    return CONSOLE_SCRIPT if name.removesuffix(".exe") == CONSOLE_SCRIPT else MODULE_COMMAND


def parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or program_name(),
        description="Check and profile every implementation side by side on a GPU (bench, the default), "
        "or check them on a CPU under Numba's CUDA simulator (tour).",
    )
    commands = parser.add_subparsers(dest="command")
    bench = commands.add_parser("bench", help="check and time every implementation on the GPU (default)")
    bench.add_argument("--ops", nargs="+", metavar="OP", help="ops to run (default: every registered op)")
    bench.add_argument("--dtype", default=None, choices=DTYPES,
                       help="the activations' dtype (default: bfloat16; the CPU tour: float32 and bfloat16)")
    bench.add_argument("--shapes", default=None, choices=("quick", "full"),
                       help="full (default): every benchmark shape; quick: the first, middle and last")
    bench.add_argument("--out", default=None, help="directory for results.csv/json, plots, traces (default: bench_out)")
    bench.add_argument("--profile", action="store_true",
                       help="also write a torch.profiler chrome trace of each implementation at the largest shape")
    bench.add_argument("--results-dir", default=None,
                       help="where the results pages go (default: <out>/pages); the pages of record that the docs "
                            "link to: --results-dir docs/results")
    bench.add_argument("--no-results", action="store_true", help="do not write the results pages")
    bench.add_argument("--impls", nargs="+", metavar="NAME",
                       help="only these implementations: names, levels (tuned, peer, ...) or 'fastest'")
    bench.add_argument("--tag", help="name the results pages <op>_<gpu>_<tag> (a partial sweep beside the full one)")
    bench.add_argument("--nproc", type=int, default=None,
                       help="GPUs (ranks) for the collective op tp_qk_norm, run under torchrun (default: 2; the CPU "
                            "tour: gloo ranks)")
    tour = commands.add_parser("tour", help="the CPU tour under Numba's CUDA simulator")
    tour.add_argument("--ops", nargs="+", metavar="OP", help="ops to run (default: every registered op)")
    tour.add_argument("--dtype", default=None, choices=DTYPES, help="only this dtype (default: float32 and bfloat16)")
    tour.add_argument("--nproc", type=int, default=None, help="gloo ranks of tp_qk_norm's tour (default: 2)")
    explain = commands.add_parser("explain", help="which kernel a call runs, and why (the tuned kernel's policy)")
    explain.add_argument("op", help="the op (qk_norm, cross_head_norm, qk_norm_rope, qk_norm_rope_cache, tp_qk_norm)")
    explain.add_argument("--shape", required=True, help="the call's sizes, comma-separated: qk_norm T,HQ,HK,D; cross_head_norm T,QH,KH; qk_norm_rope T,HQ,HK,D,ROPE,NEOX (NEOX 1 or 0); qk_norm_rope_cache T,HQ,HK,D,FP8 (FP8 1 or 0); tp_qk_norm T,QH,KH (full widths)")
    explain.add_argument("--world", type=int, help="tp_qk_norm: the group's size (default 2); each rank holds width / world")
    explain.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    explain.add_argument("--weight-dtype", choices=DTYPES,
                         help="the weights' dtype (default: the activations')")
    explain.add_argument("--rounding", default="fused", choices=("fused", "hf"))
    explain.add_argument("--layout", default="fused_qkv", choices=("fused_qkv", "separate"),
                         help="q and k as views of one fused qkv tensor (the benchmark's), or tensors of their own")
    where = explain.add_mutually_exclusive_group()
    where.add_argument("--gpu", choices=("h100", "h200"),
                       help="answer for this GPU from the policy compiled for the host (default on a machine without a GPU: h100)")
    where.add_argument("--sms", type=int, help="answer for a compute capability 9.0 GPU with this many SMs")
    return parser


def refused_on_cpu(args) -> list[str]:
    """The GPU benchmark's options that `args` sets and the CPU tour cannot honour."""
    return [flag for dest, flag in GPU_OPTIONS.items() if getattr(args, dest, None) not in (None, False)]


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
            refused = refused_on_cpu(args)
            if refused:  # exits with status 2
                cli.error(f"{', '.join(refused)}: the GPU benchmark's option{'s' if len(refused) > 1 else ''}, and "
                          f"no CUDA GPU is visible, so bench runs the CPU tour instead, which takes only "
                          f"{', '.join('--' + name for name in TOUR_OPTIONS)}: drop the rest, or run on a GPU")
            print("No CUDA GPU is visible: running the CPU tour (Numba's CUDA simulator) instead.")
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"  # before anything imports Numba or kernels_numba
    from cookbook import bench, registry

    try:  # every op by default; the collective one runs, or says why not, below
        ops = bench.resolve_ops(args.ops or registry.ops())
    except ValueError as error:
        cli.error(str(error))  # exits with status 2
    collective = [op for op in ops if op in registry.DISTRIBUTED_OPS]
    ops = [op for op in ops if op not in registry.DISTRIBUTED_OPS]
    if on_cpu:
        dtypes = (bench.resolve_dtype(args.dtype),) if args.dtype else bench.TOUR_DTYPES
        status = exit_status(bench.tour(ops=ops, dtypes=dtypes)) if ops else 0
        if collective:  # the collective op's tour: gloo ranks under torchrun
            from cookbook.bench import tp as bench_tp

            status = max(status, bench_tp.launch_tour(args.nproc or bench_tp.DEFAULT_NPROC, args.dtype))
        return status
    status = 0
    dtype = args.dtype or bench.dtype_name(bench.DEFAULT_DTYPE)
    shapes, out = args.shapes or "full", args.out or bench.DEFAULT_OUT
    if collective:  # one process per GPU, under torchrun (cookbook.bench.tp)
        from cookbook.bench import tp as bench_tp

        forward = ["--dtype", dtype, "--shapes", shapes, "--out", out,
                   *(["--results-dir", args.results_dir] if args.results_dir else []),
                   *(["--no-results"] if args.no_results else []),
                   "--command", shlex.join(["python", "-m", "cookbook", *argv])]
        # asked for by name (or its ranks): a machine that cannot run it is an error; in a sweep of every op, a skip
        status = bench_tp.launch(args.nproc, forward, asked=bool(args.ops) or args.nproc is not None)
    if not ops:
        return status
    rows = bench.run(
        ops=ops,
        dtype=dtype,
        shapes=shapes,
        out=out,
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
        cli.error(f"--shape: expected comma-separated integers (qk_norm: T,HQ,HK,D; cross_head_norm: T,QH,KH; qk_norm_rope: T,HQ,HK,D,ROPE,NEOX; qk_norm_rope_cache: T,HQ,HK,D,FP8; tp_qk_norm: T,QH,KH), got {args.shape!r}")
    try:
        answer = explainer.explain(args.op, shape=shape, dtype=getattr(torch, args.dtype), layout=args.layout,
                                   weight_dtype=getattr(torch, args.weight_dtype) if args.weight_dtype else None,
                                   gpu=args.gpu, sms=args.sms, world=args.world, rounding=args.rounding)
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
