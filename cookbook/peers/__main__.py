"""``python -m cookbook.peers [build] [--ops OP ...] [--dtype DTYPE]``: the peers of other packages.

Without ``build``: each registered peer, its package, and whether it imports here (its guard).

``build``: call every peer once at every benchmark shape it takes, so that the JIT peers
(SGLang's kernels, FlashInfer's norm and rope) compile now, several at once, and the benchmark
finds them cached: each is built by nvcc on its first call, and FlashInfer's modules take minutes.
Prints the seconds each peer spent (its builds, mostly). Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import time

import torch

from cookbook import registry
from cookbook.bench.common import checked, positional, resolve_dtype

OPS = ("qk_norm", "cross_head_norm", "qk_norm_rope", "qk_norm_rope_cache")


def external_peers(ops) -> list:
    return [impl for op in ops for impl in registry.implementations(op, ("peer",)) if impl.package]


def show(ops) -> None:
    for impl in external_peers(ops):
        reason = impl.unavailable("cuda")  # the import guard (on a CPU too: nothing is launched)
        ready = f"imports ({impl.build().label(torch.device('cuda'))})" if reason is None else reason
        print(f"{impl.op:16} {impl.name:28} {impl.package:18} {ready}")


def build_one(impl, dtype) -> str:
    """Call `impl` once per benchmark shape it takes (building its kernels); a line of report."""
    contract = registry.contract(impl.op)
    start = time.perf_counter()
    kernel = impl.build()
    called, skipped = 0, 0
    for shape in contract.BENCH_SHAPES:
        args = positional(checked(contract, contract.bench_case(shape, dtype, "cuda")[0]))
        if kernel.not_applicable(*args):
            skipped += 1
            continue
        kernel.prepare(*args)
        kernel(*args)
        called += 1
    torch.cuda.synchronize()
    return (f"{impl.op} {impl.name} ({kernel.label(torch.device('cuda'))}): {called} shapes called, "
            f"{skipped} not applicable, {time.perf_counter() - start:.1f} s")


def build(ops, dtype) -> int:
    """Every runnable peer in parallel (each builds its kernels in nvcc subprocesses)."""
    if not torch.cuda.is_available():
        raise SystemExit("python -m cookbook.peers build needs a CUDA GPU (the peers build for it)")
    runnable = [impl for impl in external_peers(ops) if impl.unavailable("cuda") is None]
    if not runnable:
        print("no peer can run here: python -m cookbook.peers says why")
        return 0
    failed = 0
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(runnable)) as pool:
        futures = {pool.submit(build_one, impl, dtype): impl for impl in runnable}
        for future in concurrent.futures.as_completed(futures):
            impl = futures[future]
            try:
                print(future.result(), flush=True)
            except Exception as error:
                failed += 1
                print(f"!! {impl.op} {impl.name}: {type(error).__name__}: {error}", flush=True)
    print(f"built the peers in {time.perf_counter() - start:.1f} s")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cookbook.peers", description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs="?", choices=("show", "build"), default="show")
    parser.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "float16", "bfloat16"))
    args = parser.parse_args(argv)
    if args.command == "build":
        return build(args.ops, resolve_dtype(args.dtype))
    show(args.ops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
