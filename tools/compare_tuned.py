#!/usr/bin/env python3
"""Old against new in one run on one GPU: an op's tuned kernel against an earlier commit's fastest.

At every bench shape, with the benchmark's own timing:

    git archive <commit> kernels_cuda | tar -x -C OLD             # the earlier commit's kernels
    python tools/compare_tuned.py --old-kernels OLD/kernels_cuda --old-commit <commit> --old-version 14
    python tools/compare_tuned.py --old-kernels OLD/kernels_cuda --old-commit <commit> --old-version tuned
    python tools/compare_tuned.py --op cross_head_norm --old-kernels OLD/kernels_cuda --old-commit <commit> --old-version 6,13,14
    python tools/compare_tuned.py --op qk_norm_rope --old-kernels OLD/kernels_cuda --old-commit <commit> --old-version 9
    python tools/compare_tuned.py --op qk_norm_rope_cache --old-kernels OLD/kernels_cuda --old-commit <commit> --old-version tuned

The earlier commit's kernels (the older layout: every version in one header, `bindings/<op>.cu`
registering `torch.ops.cookbook.<op>(..., version)`; or the ladder layout's tuned kernel, with
`--old-version tuned`) are built as their own extension beside this checkout's; both are checked
against the contract, then timed in the order old, new, new, old at every shape (the two timings
of each show the run's noise). Several old versions (`--old-version 6,13,14`): at each shape each
is timed once first and the fastest of them is the old candidate there. Writes
docs/results/<op>_<gpu>_tuned_vs_<commit>.{md,json}. `--rounds R` repeats that order R times (each candidate timed 2R times: for a shape whose timings
split into modes) and `--only TEXT` keeps the shapes whose label contains TEXT (repeatable: any of them; the page's
name then ends in `_only_<TEXT>`). `--build-only` builds both and stops (the
older layout's one translation unit takes minutes: start it early; the timing run loads it from
the cache). How each op's kernels are called: its entry of CALLS below.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from statistics import median
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cookbook import bench, cuda, registry  # noqa: E402
from cookbook.bench import sweep  # noqa: E402

# ---- the ops: how the tool calls an extension's torch op with the registry's arguments ----------
def _norm_call(op, *version):
    """The registry's qk_norm / cross_head_norm arguments -> op(q, k, q_weight, k_weight, eps,
    weight_offset, hf[, version])."""
    def run(q, k, q_weight, k_weight, eps, weight_offset, rounding):
        op(q, k, q_weight, k_weight, eps, weight_offset, rounding == "hf", *version)

    return run


def _qk_norm_rope_call(op, *version):
    """The registry's qk_norm_rope arguments -> op(q, k, q_weight, k_weight, cos_sin_cache,
    positions, eps, weight_offset, is_neox, rope_dim, position_offset, hf[, version])."""
    def run(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, rounding, is_neox, rope_dim,
            position_offset):
        op(q, k, q_weight, k_weight, cos_sin_cache, positions, eps, weight_offset, is_neox, rope_dim, position_offset,
           rounding == "hf", *version)

    return run


def _qk_norm_rope_cache_call(op, *version):
    """The registry's qk_norm_rope_cache arguments -> op(q, k, v, q_weight, k_weight, cos_sin_cache,
    positions, k_cache, v_cache, slot_mapping, k_scale, v_scale, eps, weight_offset, is_neox,
    rope_dim, hf[, version])."""
    def run(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale, v_scale, eps,
            weight_offset, rounding, is_neox, rope_dim):
        op(q, k, v, q_weight, k_weight, cos_sin_cache, positions, k_cache, v_cache, slot_mapping, k_scale, v_scale, eps,
           weight_offset, is_neox, rope_dim, rounding == "hf", *version)

    return run


CALLS = {"qk_norm": _norm_call, "cross_head_norm": _norm_call, "qk_norm_rope": _qk_norm_rope_call,
         "qk_norm_rope_cache": _qk_norm_rope_cache_call}
OPS = tuple(CALLS)  # the ops in the ladder layout, with a tuned kernel
ORDER = ("old", "new", "new", "old")  # each timed twice, interleaved


@dataclass
class Candidate:
    """Duck-types a registry implementation for the bench (name, level, version, fn)."""

    name: str
    level: str
    version: int
    fn: object


def old_tuned_candidate(op: str, kernels: Path, commit: str) -> Candidate:
    """The tuned kernel of an earlier commit in the ladder layout (`kernels_cuda/<op>/tuned.cuh`),
    built as its own extension `cookbook::<op>_tuned_<commit>` from the earlier sources."""
    from torch.utils import cpp_extension

    from kernels_cuda import Extension

    ext = Extension(op, f"{op}/tuned.cuh")
    name = f"{op}_tuned_{commit}"
    directory = Path(cuda._build_root()) / f"{name}-old"
    directory.mkdir(parents=True, exist_ok=True)
    units = {"binding.cpp": f'#include "{op}/binding.h"\nCOOKBOOK_{op.upper()}_EXTENSION({name}, {ext.namespace})\n'}
    for file_name, text in ext.kernel_units().items():  # the launchers only: an earlier commit has no explain
        units[file_name] = "".join(line + "\n" for line in text.splitlines() if "::explain<" not in line)
    for file_name, text in units.items():
        (directory / file_name).write_text(text)
    with cuda._build_environment(jobs=os.cpu_count()), cuda._build_lock(directory):
        cpp_extension.load(name=f"cookbook_{name}", sources=[str(directory / f) for f in units],
                           extra_include_paths=[str(kernels)], extra_cflags=cuda.CXX_FLAGS,
                           extra_cuda_cflags=cuda.CUDA_FLAGS, build_directory=str(directory), is_python_module=False)

    return Candidate(f"cuda_tuned@{commit}", "tuned", 0, CALLS[op](getattr(torch.ops.cookbook, name)))


def old_candidates(op: str, kernels: Path, commit: str, versions: list[int]) -> list[Candidate]:
    """Versions of an earlier commit in the older layout: its one extension, built once from
    `bindings/<op>.cu`, registering `torch.ops.cookbook.<op>(..., version)`."""
    from torch.utils import cpp_extension

    directory = Path(cuda._build_root()) / f"{op}-old-{commit}"
    directory.mkdir(parents=True, exist_ok=True)
    with cuda._build_environment(jobs=None), cuda._build_lock(directory):
        cpp_extension.load(name=f"cookbook_{op}_{commit}", sources=[str(kernels / "bindings" / f"{op}.cu")],
                           extra_include_paths=[str(kernels)], extra_cflags=cuda.CXX_FLAGS,
                           extra_cuda_cflags=cuda.CUDA_FLAGS, build_directory=str(directory), is_python_module=False)

    return [Candidate(f"cuda_v{version}@{commit}", "cuda", version, CALLS[op](getattr(torch.ops.cookbook, op), version))
            for version in versions]


def fastest_of(case, candidates: list[Candidate], copy_gb_per_s, progress) -> Candidate:
    """The candidate of `candidates` with the shortest median at `case` (each timed once)."""
    if len(candidates) == 1:
        return candidates[0]
    medians = {}
    for candidate in candidates:
        progress.begin(f"{case.base_row['label']} {candidate.name} (choosing the old candidate)")
        medians[candidate.name] = sweep.bench_impl(case, candidate, copy_gb_per_s, None, progress)["median_us"]
        progress.end()
    timed = [c for c in candidates if medians[c.name] is not None]
    return min(timed, key=lambda c: medians[c.name]) if timed else candidates[0]


def _in_repo(arg: str) -> str:
    """A path argument inside the checkout, relative to it: the page names no machine's folders."""
    path = Path(arg)
    if path.is_absolute() and path.resolve().is_relative_to(bench.REPO_ROOT):
        return path.resolve().relative_to(bench.REPO_ROOT).as_posix()
    return arg


OLD_KERNELS = "OLD/kernels_cuda"  # what a page calls the old tree: the earlier commit's, extracted as above


def page_command(argv: list[str]) -> str:
    """The command as a page shows it: paths inside the checkout relative to it, and the old kernels,
    wherever they were extracted, as OLD_KERNELS (a folder of one machine means nothing to a reader)."""
    shown, old_next = [], False
    for arg in argv:
        if old_next or arg.startswith("--old-kernels="):
            arg = OLD_KERNELS if old_next else f"--old-kernels={OLD_KERNELS}"
        old_next = arg == "--old-kernels"
        shown.append(_in_repo(arg))
    return shlex.join(["python", "tools/compare_tuned.py", *shown])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old-kernels", type=Path, required=True, help="the earlier commit's kernels_cuda/")
    parser.add_argument("--old-commit", required=True)
    parser.add_argument("--op", default="qk_norm", choices=OPS)
    parser.add_argument("--build-only", action="store_true", help="build both candidates' extensions, time nothing")
    parser.add_argument("--old-version", required=True,
                        help="its fastest CUDA C version (the older layout; several comma-separated: the fastest of "
                             "them at each shape), or 'tuned' (the ladder layout's tuned kernel)")
    parser.add_argument("--results-dir", type=Path, default=bench.REPO_ROOT / "docs" / "results")
    parser.add_argument("--rounds", type=int, default=1, help="repeat the order old, new, new, old this many times")
    parser.add_argument("--only", metavar="TEXT", action="append",
                        help="time only the shapes whose label contains TEXT (repeatable: any of them)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds: expected at least 1, got {args.rounds}")
    command = page_command(argv if argv is not None else sys.argv[1:])

    op = args.op
    tuned = registry.get(op, "cuda_tuned")
    cuda.build([tuned.extension])
    if args.old_version == "tuned":
        olds = [old_tuned_candidate(op, args.old_kernels.resolve(), args.old_commit)]
    else:
        versions = [int(v) for v in args.old_version.split(",")]
        olds = old_candidates(op, args.old_kernels.resolve(), args.old_commit, versions)
    if args.build_only:
        print(f"built {', '.join(c.name for c in olds)} and {tuned.name}")
        return 0
    new = Candidate(tuned.name, tuned.level, tuned.version, tuned.fn)
    contract = registry.contract(op)
    copy_gb_per_s = bench.copy_bandwidth_gb_per_s()
    choosing = len(olds) if len(olds) > 1 else 0
    shapes = [shape for shape in contract.BENCH_SHAPES
              if args.only is None or any(text in contract.bench_case(shape, bench.DEFAULT_DTYPE, "meta", 0)[1]
                                         for text in args.only)]
    if not shapes:
        parser.error(f"--only: no bench shape of {op} has {args.only!r} in its label")
    order = ORDER * args.rounds
    progress = bench.Progress(len(shapes) * (len(order) + choosing))
    rows = []
    for shape in shapes:
        case = bench.prepare_shape(op, contract, shape, bench.DEFAULT_DTYPE)
        old = fastest_of(case, olds, copy_gb_per_s, progress)
        timed = []
        for which in order:
            candidate = old if which == "old" else new
            progress.begin(f"{case.base_row['label']} {candidate.name}")
            timed.append((which, sweep.bench_impl(case, candidate, copy_gb_per_s, None, progress)))
            progress.end()
        medians = {which: [row["median_us"] for w, row in timed if w == which] for which in ("old", "new")}
        if None in medians["old"] + medians["new"]:
            print(f"!! {case.base_row['label']}: a candidate failed: {[row['agreement'] or row['error'] for _, row in timed]}")
            return 1
        old_us, new_us = min(medians["old"]), min(medians["new"])
        rows.append(dict(label=case.base_row["label"], shape=list(shape), old=old.name, old_us=medians["old"],
                         new_us=medians["new"], ratio=new_us / old_us, old_pct=timed[0][1]["pct_of_copy"],
                         new_pct=timed[1][1]["pct_of_copy"]))
        torch.cuda.empty_cache()
    progress.close()
    meta = bench.metadata(command, copy_gb_per_s, bench.DEFAULT_DTYPE)
    old_name = olds[0].name if len(olds) == 1 else \
        f"the fastest of {', '.join(c.name.split('@')[0] for c in olds)}@{args.old_commit}"
    meta["old"] = {"commit": args.old_commit, "implementation": old_name}
    meta["rounds"] = args.rounds
    suffix = "" if args.only is None else "_only_" + "".join(c if c.isalnum() else "_" for c in "_".join(args.only))
    write(op, rows, meta, args.results_dir, old_name, suffix)
    return 0


def write(op: str, rows, meta, results_dir: Path, old_name: str, suffix: str = "") -> None:
    rounds = meta.get("rounds", 1)
    several = any(r.get("old") != rows[0].get("old") for r in rows) or old_name.startswith("the fastest")
    body = [[r["label"], *([r["old"].split("@")[0]] if several else []), " / ".join(f"{us:.2f}" for us in r["old_us"]),
             " / ".join(f"{us:.2f}" for us in r["new_us"]), f"{r['ratio']:.3f}",
             *([f"{median(r['new_us']) / median(r['old_us']):.3f}"] if rounds > 1 else []), f"{r['old_pct']:.1f} %",
             f"{r['new_pct']:.1f} %"] for r in rows]
    nth = "1st / 2nd" if rounds == 1 else "in timing order"
    headers = ["shape", *(["old version"] if several else []), f"{'old' if several else old_name} us ({nth})",
               f"cuda_tuned us ({nth})", "best new / best old", *(["median new / median old"] if rounds > 1 else []),
               "old % of copy", "new % of copy"]
    table = bench.markdown_table(headers, body)
    stem = f"{op}_{meta['gpu_slug']}_tuned_vs_{meta['old']['commit']}{suffix}"
    page = [f"# {op}: the tuned kernel against {old_name}, one run, {meta['gpu']}", "",
            "Written by `tools/compare_tuned.py`: do not edit by hand, run the command again.", "",
            f"- GPU: {meta['gpu']}; torch {meta['torch']}, CUDA {meta['cuda']}",
            f"- date: {meta['date']}; commit: {meta['commit']}; old: {meta['old']['commit']}",
            f"- command: `{meta['command']}`",
            f"- timing: {meta['timing']}; each candidate timed {2 * rounds} times, in the order old, new, new, old"
            + (f" repeated {rounds} times" if rounds > 1 else "")
            + ("; the old version at each shape: the fastest of a first timing of each" if several else ""),
            f"- device-to-device copy: {meta['copy_tb_per_s']:.2f} TB/s", "", table, ""]
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"{stem}.md").write_text("\n".join(page))
    (results_dir / f"{stem}.json").write_text(json.dumps({"metadata": meta, "rows": rows}, indent=1))
    print(table)
    print(f"wrote {results_dir / (stem + '.md')}")


if __name__ == "__main__":
    raise SystemExit(main())
